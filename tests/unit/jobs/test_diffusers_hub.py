"""An hf:// checkpoint is known on the driver before any work: its model_index.json is read from
a hub cache (the user's, or the job's model.cache_dir/hub that the nodes fill), else that one file
from the hub (workers.weights.hub.read_hub_index). So its family (buckets, sampling defaults) is
its class's, one that cannot run here is refused by validate and plan naming what to do, and one
that cannot be read is said in plan's notes and checked by the actor. No network here: the hub is
offline and the caches are built in the test, in huggingface_hub's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import load_spec
from ditfleet.model.family import model_family, model_task
from ditfleet.workers.weights.hub import _allow_for_index
from tests.support.model_fixtures import job_with_model as job
from tests.unit.jobs.test_diffusers_defaults import FLUX_INDEX

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _cached(cache_dir: Path, repo_id: str, index: dict) -> None:
    """repo_id's model_index.json in cache_dir/hub as a download leaves it (refs/main -> a snapshot)."""
    storage = cache_dir / "hub" / f"models--{repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    (storage / "snapshots" / COMMIT).mkdir(parents=True)
    (storage / "snapshots" / COMMIT / "model_index.json").write_text(json.dumps(index))


def _hub_job(tmp_path: Path, repo_id: str) -> Path:
    return job(tmp_path, f"hf://{repo_id}@main", f"  cache_dir: {tmp_path / 'cache'}\n")


def test_an_hf_checkpoint_in_the_jobs_hub_cache_is_its_classs_family(tmp_path, capsys):
    _cached(tmp_path / "cache", "acme/flux-toy", FLUX_INDEX)
    path = _hub_job(tmp_path, "acme/flux-toy")
    spec = load_spec(path)
    assert model_family("hf://acme/flux-toy@main").name == "diffusers:FluxPipeline"
    assert model_task("hf://acme/flux-toy@main") == "text-to-image"
    assert spec.bucket_names()[0] == "1024x1024"  # the diffusers family's buckets, not Qwen-Image's
    defaults = spec.sampling_defaults
    assert defaults.values["steps"] == 28 and defaults.notes == ()
    assert spec.to_worker_config().pipeline.max_sequence_length == 512
    assert main(["plan", str(path)]) == 0
    assert "(checkpoint: FluxPipeline.__call__, recognised by diffusers' FluxPipeline.__call__ defaults)" in (
        capsys.readouterr().out
    )


def test_an_hf_edit_checkpoint_is_an_edit_model_on_the_driver(tmp_path, capsys):
    """A Kontext checkpoint on the hub is an edit model before any work: a text job on it is
    refused by validate (issue 51: an edit model runs edit jobs), not by each actor."""
    _cached(tmp_path / "cache", "acme/kontext", {**FLUX_INDEX, "_class_name": "FluxKontextPipeline"})
    assert main(["validate", str(_hub_job(tmp_path, "acme/kontext"))]) == 2
    assert "image_column" in capsys.readouterr().err
    assert model_task("hf://acme/kontext@main") == "edit"


def test_an_hf_checkpoint_that_cannot_run_is_refused_before_any_work(tmp_path, capsys):
    _cached(
        tmp_path / "cache", "acme/inpaint", {**FLUX_INDEX, "_class_name": "StableDiffusion3InpaintPipeline"}
    )
    path = _hub_job(tmp_path, "acme/inpaint")
    for command in ("validate", "plan"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert "hf://acme/inpaint@main (model_index.json)" in err and "needs ['mask_image']" in err, err
    assert not (tmp_path / "out").exists()


def test_an_hf_checkpoint_not_readable_here_is_a_note_and_the_actor_checks_it(tmp_path, capsys):
    path = _hub_job(tmp_path, "acme/nowhere")
    spec = load_spec(path)
    (note,) = spec.sampling_defaults.notes
    assert "HF_HUB_OFFLINE is set and model_index.json is in no hub cache here" in note
    assert "checked when an actor fetches it" in note
    assert main(["plan", str(path)]) == 0
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().out


def test_a_snapshot_fetches_every_component_folder_its_index_names(tmp_path):
    index = {
        **FLUX_INDEX,
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
    }
    _cached(tmp_path / "cache", "acme/flux-full", index)
    allowed = _allow_for_index("acme/flux-full", "main", tmp_path / "cache" / "hub")
    assert {"model_index.json", "transformer/*", "text_encoder_2/*", "tokenizer_2/*"} <= set(allowed)


def test_a_named_hf_checkpoints_licence_is_its_cards_and_a_commercial_job_refuses_flux_dev(tmp_path, capsys):
    """issue 49 section 4 on the hub: FLUX.1-dev's card is not read to plan, but its licence is
    known (the table of named checkpoints), so model.require_commercial_licence refuses it before
    any work; FLUX.1-schnell's (apache-2.0) passes."""
    dev = job(tmp_path, "hf://black-forest-labs/FLUX.1-dev", "  require_commercial_licence: true\n")
    licence = load_spec(dev).model_licence
    assert licence.id == "flux-1-dev-non-commercial-license" and licence.commercial_use is False
    assert "black-forest-labs/FLUX.1-dev's model card" in licence.source
    assert main(["validate", str(dev)]) == 2
    assert "flux-1-dev-non-commercial-license" in capsys.readouterr().err
    (tmp_path / "s").mkdir()
    schnell = job(
        tmp_path / "s", "hf://black-forest-labs/FLUX.1-schnell", "  require_commercial_licence: true\n"
    )
    assert main(["validate", str(schnell)]) == 0, capsys.readouterr().err
