"""A job's sampling defaults come from the checkpoint's publisher where the job says nothing:
nvidia/Qwen-Image-Flash (4 steps, CFG off) and Qwen-Image-Lightning (merged: 8 steps; LoRAs: 4 or
8 steps with Lightning's scheduler), recognised by scheduler config, LoRA file name or hub id; the
job's values win; `plan` and `inspect` say which value came from where; `_job.json` records it."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import load_spec
from ditfleet.jobs.spec.sampling_defaults import DITFLEET, JOB
from ditfleet.model.qwen_image.published.schedules import (
    FLASH,
    LIGHTNING,
    LIGHTNING_LORAS,
    by_lora,
    schedule_key,
)
from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.digest import job_file_identities
from ditfleet.workers.weights.fetch import fetch_file
from tests.support.model_fixtures import job_with_model as job
from tests.support.model_fixtures import tiny_model_copy


def test_flash_is_recognised_by_its_scheduler_and_runs_its_schedule(tmp_path, capsys):
    path = job(tmp_path, tiny_model_copy(tmp_path, scheduler=FLASH.scheduler_path()))
    spec = load_spec(path)
    rows = spec.row_config()
    assert (rows.steps, rows.true_cfg_scale, rows.negative_prompt) == (4, 1.0, None)
    where = spec.sampling_defaults.sources["steps"]
    assert (
        where
        == f"checkpoint: nvidia/Qwen-Image-Flash, recognised by its scheduler config {tmp_path}/model/scheduler/scheduler_config.json"
    )
    assert spec.to_worker_config().scheduler_config is None  # the checkpoint's own scheduler
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "sampling: steps 4, true_cfg_scale 1.0, negative_prompt None (checkpoint: nvidia/Qwen-Image-Flash"
        in out
    )
    assert "; scheduler: the checkpoint's own (its scheduler/ folder)" in out
    assert main(["validate", str(path)]) == 0
    assert (
        "sampling: steps 4, true_cfg_scale 1.0, negative_prompt None (checkpoint" in capsys.readouterr().out
    )
    resolved = spec.resolved()["sampling"]  # what _job.json stores
    assert resolved["steps"] == 4 and resolved["negative_prompt"] is None
    assert resolved["defaults_from"]["steps"].startswith("checkpoint: nvidia/Qwen-Image-Flash")


def test_the_jobs_values_win_key_by_key(tmp_path, capsys):
    model = tiny_model_copy(tmp_path, scheduler=FLASH.scheduler_path())
    path = job(tmp_path, model, "sampling:\n  steps: 6\n")
    spec = load_spec(path)
    rows = spec.row_config()
    assert (rows.steps, rows.true_cfg_scale, rows.negative_prompt) == (6, 1.0, None)
    assert spec.sampling_defaults.sources["steps"] == JOB
    assert spec.sampling_defaults.sources["true_cfg_scale"].startswith("checkpoint: nvidia/Qwen-Image-Flash")
    assert main(["plan", str(path), "--json"]) == 0
    sampling = json.loads(capsys.readouterr().out)["sampling"]
    assert sampling["steps"] == {"value": 6, "from": "job"}
    assert sampling["checkpoint"] == "nvidia/Qwen-Image-Flash"
    # Given the same value as the default, it is still the job's (and stays so if the checkpoint changes).
    same = load_spec(job(tmp_path, model, "sampling:\n  steps: 50\n  true_cfg_scale: 4.0\n"))
    assert same.row_config().steps == 50 and same.row_config().true_cfg_scale == 4.0
    assert same.sampling_defaults.sources["negative_prompt"].startswith("checkpoint")


def test_an_unrecognised_checkpoint_keeps_ditfleets_defaults(tmp_path):
    spec = load_spec(job(tmp_path, "tiny"))
    rows = spec.row_config()
    assert (rows.steps, rows.true_cfg_scale) == (50, 4.0)
    assert set(spec.sampling_defaults.sources.values()) == {DITFLEET, "its scheduler/ folder"}
    assert spec.sampling_defaults.checkpoint is None


def test_a_merged_lightning_checkpoint_defaults_to_its_8_steps(tmp_path):
    spec = load_spec(job(tmp_path, tiny_model_copy(tmp_path, scheduler=LIGHTNING.scheduler_path())))
    assert spec.row_config().steps == 8 and spec.row_config().negative_prompt is None


@pytest.mark.parametrize("lora", LIGHTNING_LORAS, ids=lambda s: str(s.steps))
def test_a_lightning_lora_brings_its_steps_and_scheduler(tmp_path, lora):
    name = f"Qwen-Image-Lightning-{lora.steps}steps-V1.0.safetensors"
    extra = f"  loras:\n    - path: {tmp_path / name}\n"
    spec = load_spec(job(tmp_path, "tiny", extra))
    worker = spec.to_worker_config()
    assert (worker.rows.steps, worker.rows.true_cfg_scale, worker.rows.negative_prompt) == (
        lora.steps,
        1.0,
        None,
    )
    # As each node finds it in its own installed package, identified by its bytes.
    assert worker.scheduler_config == "published:qwen-image-lightning/scheduler/scheduler_config.json"
    assert str(fetch_file(worker.scheduler_config, tmp_path, S3Config())) == lora.scheduler_path()
    digest = hashlib.sha256(Path(lora.scheduler_path()).read_bytes()).hexdigest()
    assert job_file_identities((), worker.scheduler_config, None) == {
        f"scheduler config {worker.scheduler_config}": f"sha256:{digest}"
    }
    assert spec.image_settings()["scheduler_config"] == worker.scheduler_config  # in the fingerprint
    assert (
        spec.sampling_defaults.sources["scheduler"]
        == f"checkpoint: {lora.name}, recognised by its LoRA file {name}"
    )
    # The job's own scheduler_config wins over the LoRA's.
    own = load_spec(job(tmp_path, "tiny", extra + f"  scheduler_config: {FLASH.scheduler_path()}\n"))
    assert own.to_worker_config().scheduler_config == FLASH.scheduler_path()
    assert own.sampling_defaults.sources["scheduler"] == JOB


def test_a_published_uri_names_only_published_files(tmp_path):
    from ditfleet.model.qwen_image.published.schedules import published_file

    for bad in (
        "published:../schedules.py",
        "published:qwen-image-lightning/nope.json",
        "published:/etc/passwd",
    ):
        with pytest.raises(ValueError, match="not a published config file"):
            published_file(bad)


def test_recognition_by_hub_id_and_by_name_only_where_published():
    assert by_lora("s3://b/l/Qwen-Image-Lightning-8steps-V2.0.safetensors") is LIGHTNING_LORAS[1]
    assert by_lora("my-lightning-ish.safetensors") is None
    from ditfleet.jobs.spec.sampling_defaults import recognise

    found, _ = recognise("hf://nvidia/Qwen-Image-Flash@main", (), None, None)
    assert found is not None and found.schedule is FLASH and found.how == "its hub id nvidia/Qwen-Image-Flash"
    base, _ = recognise("hf://Qwen/Qwen-Image-2512@main", (), None, None)
    assert base is not None and base.schedule.defaults() == {
        "steps": 50,
        "true_cfg_scale": 4.0,
        "negative_prompt": " ",
    }
    assert recognise("hf://someone/Qwen-Image-Flash-fork@main", (), None, None)[0] is None


def test_the_same_schedule_spelled_with_other_keys_is_recognised_and_a_bad_file_is_a_note(tmp_path):
    flash = json.loads(Path(FLASH.scheduler_path()).read_text())
    bare = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "shift_terminal": None}
    assert schedule_key(bare) == schedule_key(flash)  # static shift: the dynamic keys do not count
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "scheduler_config.json").write_text("{not json")
    spec = load_spec(job(tmp_path, "tiny", f"  scheduler_config: {bad}\n"))
    assert spec.sampling_defaults.checkpoint is None
    assert "not read (JSONDecodeError" in spec.sampling_defaults.notes[0]


def test_inspect_says_which_defaults_the_checkpoint_gives(tmp_path, capsys):
    model = tiny_model_copy(tmp_path, scheduler=FLASH.scheduler_path())
    assert main(["inspect", str(model)]) == 0
    out = capsys.readouterr().out
    assert (
        "sampling defaults: 4 steps, true_cfg_scale 1 (CFG off), negative_prompt None (checkpoint: nvidia/Qwen-Image-Flash"
        in out
    )
    assert main(["inspect", "tiny"]) == 0
    assert (
        "sampling defaults: ditfleet's (no published few-step schedule recognised)" in capsys.readouterr().out
    )


# Flash and Lightning run one trajectory (a constant shift of 3) with other steps (4, 8), and
# Flash's scheduler file is a reconstruction: neither may be taken for the other silently.


def test_flash_and_lightning_share_a_trajectory_that_their_scheduler_files_spell_apart():
    from ditfleet.model.qwen_image.published.schedules import (
        by_scheduler,
        published_scheduler,
        trajectory,
        trajectory_twins,
    )

    flash, lightning = published_scheduler(FLASH), published_scheduler(LIGHTNING)
    assert trajectory(flash) == trajectory(lightning) == (None, 3.0)
    assert by_scheduler(flash) is FLASH and by_scheduler(lightning) is LIGHTNING
    assert trajectory_twins(FLASH) == (LIGHTNING,) and trajectory_twins(LIGHTNING) == (FLASH,)
    # Each one's trajectory in the other's spelling is recognised by that spelling only.
    static_lightning = {**lightning, "use_dynamic_shifting": False, "shift": 3.0}
    dynamic_flash = {
        **flash,
        "use_dynamic_shifting": True,
        "base_shift": math.log(3),
        "max_shift": math.log(3),
    }
    assert by_scheduler(static_lightning) is FLASH and by_scheduler(dynamic_flash) is LIGHTNING
    # A schedule whose shift depends on the image size has no constant trajectory.
    assert trajectory({**lightning, "max_shift": 1.5}) is None


@pytest.mark.parametrize("schedule", [FLASH, LIGHTNING], ids=lambda s: s.folder)
def test_a_checkpoint_recognised_by_its_scheduler_alone_names_its_twin_in_validate_plan_and_inspect(
    tmp_path, capsys, schedule
):
    twin = LIGHTNING if schedule is FLASH else FLASH
    model = tiny_model_copy(tmp_path, scheduler=schedule.scheduler_path())
    spec = load_spec(job(tmp_path, model))
    assert (
        spec.row_config().steps == schedule.steps and spec.sampling_defaults.checkpoint.schedule is schedule
    )
    [note] = spec.sampling_defaults.notes
    assert f"runs the trajectory that {twin.name} ({twin.steps} steps) runs too" in note
    assert f"taken for {schedule.name} ({schedule.steps} steps)" in note and "set sampling.steps" in note
    assert main(["validate", str(job(tmp_path, model))]) == 0
    assert note in capsys.readouterr().out
    assert main(["inspect", str(model)]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    # The job's steps decide, and the note stays: the rest of the defaults are the same for both.
    given = load_spec(job(tmp_path, model, f"sampling:\n  steps: {twin.steps}\n"))
    assert given.row_config().steps == twin.steps and given.row_config().true_cfg_scale == 1.0


def test_a_hub_id_names_the_checkpoint_before_a_scheduler_spells_its_twin(tmp_path):
    from ditfleet.jobs.spec.sampling_defaults import recognise

    # Flash by hub id, run with Lightning's scheduler file: still Flash's 4 steps, and no twin note
    # (the hub id names the checkpoint; the job's scheduler_config is the scheduler it runs).
    found, notes = recognise("hf://nvidia/Qwen-Image-Flash@main", (), LIGHTNING.scheduler_path(), None)
    assert found is not None and found.schedule is FLASH and notes == ()
    # Lightning LoRA files are Lightning's whatever the base, and no file name is taken for Flash.
    for name in (
        "Qwen-Image-Lightning-4steps-V1.0.safetensors",
        "Qwen-Image-Lightning-8steps-V2.0.safetensors",
    ):
        assert by_lora(name) in LIGHTNING_LORAS
        found, _ = recognise("hf://nvidia/Qwen-Image-Flash@main", (f"s3://b/{name}",), None, None)
        assert found is not None and found.schedule in LIGHTNING_LORAS
    for name in ("Qwen-Image-Flash.safetensors", "nvidia-Qwen-Image-Flash-4steps.safetensors"):
        assert by_lora(name) is None
    # No Lightning hub id (there is none for merged weights) is taken for Flash, nor a fork's.
    for repo in ("lightx2v/Qwen-Image-Lightning", "someone/Qwen-Image-Flash-Lightning"):
        assert recognise(f"hf://{repo}@main", (), None, None)[0] is None
