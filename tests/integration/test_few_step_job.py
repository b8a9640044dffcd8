"""The native few-step path as a whole `ditfleet run` on a real local Ray: a toy-width random
checkpoint recognised as nvidia/Qwen-Image-Flash or a merged Qwen-Image-Lightning by its published
scheduler, a job that says no steps and no CFG, an actor SIGKILLed mid-job. Every row is made
exactly once at the checkpoint's published schedule (4 or 8 steps, CFG off), with the same
images an uninterrupted run makes, and `verify` is clean."""

from __future__ import annotations

import threading

import pytest

from ditfleet.jobs.cli import main
from ditfleet.model.qwen_image.published.schedules import FLASH, LIGHTNING
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.integration.test_end_to_end import _kill_writers_of_new_manifests, images_by_key, write_job
from tests.support.model_fixtures import model_copy
from tests.support.worker_fixtures import write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@pytest.mark.parametrize("schedule", [FLASH, LIGHTNING], ids=lambda s: s.folder)
def test_a_few_step_job_with_an_actor_killed_gives_every_row_once_at_its_schedule(
    random_model_dir, tmp_path, capsys, schedule
):
    model = model_copy(random_model_dir, tmp_path / "model", scheduler=schedule.scheduler_path())
    prompts = write_prompts(tmp_path / "prompts.parquet", 16)

    def run(name: str, workers: int, kills: int) -> dict:
        out = tmp_path / name
        job = write_job(
            tmp_path / f"{name}.yaml", model, prompts, str(out),
            sampling="{seed: 7}",  # no steps, no CFG: the checkpoint's published schedule
            workers=f"{{min: {workers}, max: {workers}, gpus: 0, cpus: 1, batch_size: 2, idle_retire_s: 2}}",
            shards="{size: 2}",
        )  # fmt: skip
        killed: list[int] = []
        killer = threading.Thread(
            target=_kill_writers_of_new_manifests, args=(out, kills, 1, killed), daemon=True
        )
        if kills:
            killer.start()
        code = main(["run", str(job)])
        killer.join(timeout=10) if kills else None
        err = capsys.readouterr().err
        assert code == 0 and len(killed) == kills, err
        if kills:
            assert "lost (actor_died)" in err
        assert main(["verify", str(out)]) == 0, capsys.readouterr().err
        store = open_store(str(out))
        made = read_manifests(store).to_pylist()
        rows = {(r["steps"], r["true_cfg_scale"], r["negative_prompt"], r["status"]) for r in made}
        assert rows == {(schedule.steps, 1.0, None, "ok")}, rows
        return images_by_key(store)  # also: no (row, image) twice in the manifests

    killed_run = run("killed", 2, 1)
    assert sorted(id for id, _ in killed_run) == [f"p{i:05d}" for i in range(16)], "every row exactly once"
    assert killed_run == run("clean", 1, 0), "the images of an uninterrupted run"
