"""What the model brings travels with the images, in whole `ditfleet run`s on a real local Ray:
the model card's licence in `_job.json`, every manifest row and every PNG's own metadata (its
`parameters` and `ditfleet` text chunks); a few-step checkpoint's published schedule, where the
job gives none, in every row and in `_job.json`."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from ditfleet.jobs.cli import main
from ditfleet.model.qwen_image.published.schedules import FLASH
from ditfleet.workers.output.layout import job_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.support.model_fixtures import job_with_model, model_copy, tiny_model_copy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_a_tiny_job_records_the_model_cards_licence_everywhere(tmp_path):
    model = tiny_model_copy(tmp_path, "---\nlicense: apache-2.0\ntags: [tiny]\n---\n# tiny\n")
    job = job_with_model(
        tmp_path,
        model,
        "  require_commercial_licence: true\n",
        "sampling: {steps: 2, seed: 7}\nbuckets: {names: [32x32]}\ncompile: {vae: false}\n"
        "workers: {min: 1, max: 1, gpus: 0, cpus: 1, batch_size: 8}\nshards: {size: 2}\n",
    )
    out = tmp_path / "out"
    assert main(["run", str(job)]) == 0

    store = open_store(str(out))
    spec = json.loads(store.get(job_key()))["spec"]
    assert spec["model"]["license"] == "apache-2.0" and spec["model"]["license_commercial_use"] is True
    assert spec["model"]["license_source"] == f"{model / 'README.md'} front matter"
    table = read_manifests(store)
    assert table.num_rows == 3 and set(table.column("model_license").to_pylist()) == {"apache-2.0"}
    root = store.uri()
    for uri in table.column("uri").to_pylist():
        image = Image.open(io.BytesIO(store.get(uri[len(root) :].lstrip("/"))))
        assert json.loads(image.text["ditfleet"])["model_license"] == "apache-2.0"
        assert "License: apache-2.0" in image.text["parameters"]


def test_a_flash_checkpoint_runs_its_published_schedule_when_the_job_says_nothing(random_model_dir, tmp_path):
    """A toy-width checkpoint with nvidia/Qwen-Image-Flash's scheduler and a job with no sampling
    keys: every image is made at 4 steps with CFG off, and _job.json says the checkpoint gave them."""
    model = model_copy(random_model_dir, tmp_path / "flash", scheduler=FLASH.scheduler_path())
    job = job_with_model(
        tmp_path,
        model,
        rest="buckets: {names: [32x32]}\ncompile: {vae: false}\n"
        "workers: {min: 1, max: 1, gpus: 0, cpus: 1, batch_size: 4}\n",
    )
    assert main(["run", str(job)]) == 0
    store = open_store(str(tmp_path / "out"))
    sampling = json.loads(store.get(job_key()))["spec"]["sampling"]
    assert (sampling["steps"], sampling["true_cfg_scale"], sampling["negative_prompt"]) == (4, 1.0, None)
    assert sampling["defaults_from"]["steps"].startswith("checkpoint: nvidia/Qwen-Image-Flash")
    rows = read_manifests(store).to_pylist()
    assert len(rows) == 3 and {(r["steps"], r["true_cfg_scale"], r["negative_prompt"]) for r in rows} == {
        (4, 1.0, None)
    }
    assert {r["status"] for r in rows} == {"ok"}
