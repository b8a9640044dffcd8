"""A checkpoint run through diffusers takes its publisher's sampling defaults where the job says
nothing (model/diffusers_pipeline/published.py: recognised by hub id, from `hf://` or a hub cache's
snapshot folder), else its pipeline class's own `__call__` defaults read from diffusers' source:
steps, guidance, whether guidance is on, and the text length (model.max_sequence_length, passed
where the `__call__` takes it). The job's values win; `plan` says which came from where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import load_spec
from ditfleet.jobs.spec.sampling_defaults import JOB
from ditfleet.model.diffusers_pipeline.published import CFG, CHECKPOINTS, DISTILLED, OFF
from ditfleet.workers.weights.licence import KNOWN_LICENCES
from tests.support.model_fixtures import job_with_model as job
from tests.support.paths import REPO

FLUX_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def _flux_folder(root: Path, guidance_embeds: bool) -> Path:
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(FLUX_INDEX))
    (root / "transformer" / "config.json").write_text(json.dumps({"guidance_embeds": guidance_embeds}))
    return root


def test_an_unlisted_checkpoint_takes_its_pipeline_classs_call_defaults(tmp_path, capsys):
    path = job(tmp_path, _flux_folder(tmp_path / "flux", guidance_embeds=True))
    spec = load_spec(path)
    defaults = spec.sampling_defaults
    assert defaults.values == {"steps": 28, "true_cfg_scale": 3.5, "negative_prompt": ""}
    assert (
        defaults.sources["steps"]
        == "checkpoint: FluxPipeline.__call__, recognised by diffusers' FluxPipeline.__call__ defaults"
    )
    assert defaults.guidance == DISTILLED
    assert spec.to_worker_config().pipeline.max_sequence_length == 512
    rows = spec.row_config()
    assert (rows.steps, rows.true_cfg_scale) == (28, 3.5)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "sampling: steps 28, true_cfg_scale 3.5, negative_prompt '' (checkpoint: FluxPipeline.__call__" in out
    )
    assert "max_sequence_length 512 (checkpoint: FluxPipeline.__call__" in out
    assert "guidance_scale: distilled guidance" in out
    # A FLUX transformer without a guidance input (FLUX.1-schnell's kind) ignores the scale: off.
    other = load_spec(job(tmp_path / "b", _flux_folder(tmp_path / "b" / "flux", guidance_embeds=False)))
    assert (
        other.sampling_defaults.guidance == OFF and other.sampling_defaults.values["negative_prompt"] is None
    )


def test_a_checkpoint_in_a_hub_cache_is_recognised_by_its_hub_id_and_the_job_wins(tmp_path):
    snapshot = tmp_path / "hub" / "models--black-forest-labs--FLUX.1-schnell" / "snapshots" / "abc123"
    path = job(tmp_path, _flux_folder(snapshot, guidance_embeds=False))
    spec = load_spec(path)
    assert spec.sampling_defaults.values == {"steps": 4, "true_cfg_scale": 0.0, "negative_prompt": None}
    assert spec.sampling_defaults.sources["steps"] == (
        "checkpoint: black-forest-labs/FLUX.1-schnell, recognised by its hub id black-forest-labs/FLUX.1-schnell"
    )
    assert spec.to_worker_config().pipeline.max_sequence_length == 256  # its card's
    assert spec.resolved()["sampling"]["defaults_from"]["steps"].startswith("checkpoint: black-forest-labs")
    mine = load_spec(job(tmp_path, snapshot, "  max_sequence_length: 128\n", "sampling: {steps: 6}\n"))
    assert mine.sampling_defaults.values["steps"] == 6 and mine.sampling_defaults.sources["steps"] == JOB
    assert mine.sampling_defaults.max_sequence_length is None
    assert mine.to_worker_config().pipeline.max_sequence_length == 128


@pytest.mark.parametrize(
    ("hub_id", "want", "guidance", "text_length"),
    [
        ("stabilityai/stable-diffusion-3.5-large", (28, 3.5, ""), CFG, 256),  # SD3's __call__: 256 tokens
        ("Tongyi-MAI/Z-Image-Turbo", (9, 0.0, None), OFF, 512),
        ("black-forest-labs/FLUX.1-dev", (50, 3.5, ""), DISTILLED, 512),
        ("Qwen/Qwen-Image-2.1", (40, 1.0, None), OFF, None),  # its __call__ takes no text length
    ],
)
def test_an_hf_path_is_recognised_by_its_hub_id(tmp_path, monkeypatch, hub_id, want, guidance, text_length):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # its model_index.json is not read here
    spec = load_spec(job(tmp_path, f"hf://{hub_id}@main"))
    defaults = spec.sampling_defaults
    assert tuple(defaults.values.values()) == want and defaults.guidance == guidance
    label = f"checkpoint: {hub_id}, recognised by its hub id {hub_id}"
    assert defaults.max_sequence_length == (None if text_length is None else (text_length, label))


def test_a_native_checkpoint_keeps_its_text_length(tmp_path):
    spec = load_spec(job(tmp_path, "tiny"))
    assert spec.sampling_defaults.max_sequence_length is None
    assert spec.to_worker_config().pipeline.max_sequence_length == 512


def test_the_docs_table_is_the_code_table():
    """docs/real-model.md's table of named diffusers checkpoints says what CHECKPOINTS holds
    (hub id, class, steps, guidance, licence), row for row, and each licence is one ditfleet knows."""
    text = (REPO / "docs" / "real-model.md").read_text()
    rows = [
        line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ") and "/" in line.split(" | ")[0]
    ]
    documented = {r[0].removeprefix("| "): r for r in rows if len(r) == 7}
    assert set(documented) == {c.name for c in CHECKPOINTS}
    for c in CHECKPOINTS:
        _, class_name, steps, guidance, _, licence, _ = documented[c.name]
        assert (class_name, int(steps), float(guidance.split()[0]), licence) == (
            c.class_name, c.steps, c.true_cfg_scale, c.licence,
        ), c.name  # fmt: skip
        assert c.licence in KNOWN_LICENCES


def test_inspect_says_a_diffusers_checkpoints_defaults_and_that_its_memory_is_measured(tmp_path, capsys):
    root = _flux_folder(tmp_path / "flux", guidance_embeds=True)
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "sampling defaults: 28 steps, true_cfg_scale 3.5 (distilled guidance" in out
    assert "text length: 512 tokens (checkpoint: FluxPipeline.__call__" in out
    assert "memory: measured at warm-up on each actor" in out
