"""A user's own `model/` and `jobs/` packages cannot shadow ours.

`ray job submit --working-dir .` from a user's repository puts that directory first on every
worker's path, and ML repositories very often have a `model/` or `jobs/` package. ditfleet's
layers install as `ditfleet.model`, `ditfleet.jobs`, ..., so the job runs whatever the working
directory holds. The user's packages here fail loudly when imported: a run that imported either
would not succeed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditfleet.workers.output.layout import success_key
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import write_prompts

SHADOWS = ("model", "jobs", "compile", "workers", "driver")


def _user_repository(root: Path) -> Path:
    for name in SHADOWS:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('the user\\'s own {name} package was imported by ditfleet')\n"
        )
    (root / "train.py").write_text("import model  # the user's code, not ours\n")
    return root


@pytest.mark.slow
def test_a_job_submitted_from_a_repository_with_its_own_model_and_jobs_packages_succeeds(
    random_model_dir, ray_head, tmp_path
):
    repo = _user_repository(tmp_path / "user-repo")
    prompts = write_prompts(tmp_path / "prompts.parquet", 6)
    out = tmp_path / "out"
    job = repo / "job.yaml"
    job.write_text(
        f"input: {{path: {prompts}}}\n"
        f"output: {{uri: '{out}'}}\n"
        f"model: {{path: {random_model_dir}}}\n"
        "sampling: {steps: 2, seed: 7}\n"
        "buckets: {names: [32x32, 48x32]}\n"
        "compile: {vae: false}\n"
        "workers: {min: 1, gpus: 0, cpus: 1, batch_size: 8, idle_retire_s: 2}\n"
    )
    # The entrypoint runs inside Ray's copy of the working dir, where `model/` and `jobs/` come first.
    done = ray_head.job_submit(
        ["--working-dir", str(repo), "--", "ditfleet", "run", "job.yaml"], timeout_s=400
    )
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-4000:]
    assert "was imported by ditfleet" not in logs, logs[-4000:]
    summary = json.loads(open_store(str(out)).get(success_key()))
    assert summary["images"] == {"planned": 6, "ok": 6, "failed": 0}
