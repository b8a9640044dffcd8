"""`ditfleet submit` against a real `ray start --head` cluster: a scheduler that fires twice for one slot
submits the job once, and the driver's exit code comes back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ditfleet.workers.output.layout import success_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO
from tests.support.worker_fixtures import write_prompts


def _job(tmp_path: Path, model_dir: Path, prompts: Path, name: str, out: Path) -> Path:
    job = tmp_path / f"{name}.yaml"
    job.write_text(
        f"name: {name}\ninput: {{path: {prompts}}}\noutput: {{uri: {out}}}\nmodel: {{path: {model_dir}}}\n"
        "sampling: {steps: 2, seed: 7}\nbuckets: {names: [32x32, 48x32]}\ncompile: {vae: false}\n"
        "workers: {min: 1, gpus: 0, cpus: 1, batch_size: 8}\nshards: {size: 6}\n"
    )
    return job


def _submit(head, args: list[str]) -> subprocess.Popen:
    """`ditfleet submit` as a scheduler runs it: its own process, here with the test cluster's
    environment (token authentication on, as the head has it)."""
    env = {**head.env, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-m", "ditfleet.jobs.cli", "submit", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen, timeout_s: float = 400) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def _jobs_on(head) -> list[dict]:
    """Every job the head knows, read by the job SDK in a process of its own."""
    code = (
        "import json, sys; from ray.job_submission import JobSubmissionClient; "
        "jobs = JobSubmissionClient(sys.argv[1]).list_jobs(); "
        "print(json.dumps([{'id': j.submission_id, 'status': str(j.status), 'meta': j.metadata} for j in jobs]))"
    )
    env = {**head.env, "RAY_AUTH_MODE": "token"}
    done = subprocess.run(
        [sys.executable, "-c", code, head.dashboard_url], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_slot_submitted_twice_runs_once(random_model_dir, ray_head, tmp_path: Path):
    prompts = write_prompts(tmp_path / "in" / "prompts.parquet", 12)
    out = tmp_path / "out"
    job = _job(tmp_path, random_model_dir, prompts, "nightly", out)
    args = [str(job), "--address", ray_head.dashboard_url, "--slot", "2024-06-01", "--wait"]
    args += ["--working-dir", str(tmp_path)]
    # The scheduler fires twice at once, and both wait for the job's end.
    results = [_finish(p) for p in [_submit(ray_head, args), _submit(ray_head, args)]]
    text = "\n".join(r[1] for r in results)
    assert [r[0] for r in results] == [0, 0], text[-4000:]
    assert text.count("submitted: ditfleet run nightly.yaml") == 1, text[-4000:]
    assert "not submitting it again" in text or "attaching to it" in text
    assert "job succeeded" in text  # the job's own log, followed by --wait

    jobs = _jobs_on(ray_head)
    assert [(j["id"], j["meta"]["ditfleet_slot"]) for j in jobs] == [
        ("ditfleet-nightly-2024-06-01", "2024-06-01")
    ]
    store = open_store(str(out))
    ids = read_manifests(store).column("id").to_pylist()
    assert sorted(ids) == [f"p{i:05d}" for i in range(12)]
    assert json.loads(store.get(success_key()))["status"] == "succeeded"

    # The slot's job is over: submitting it again starts nothing and returns its status.
    code, text = _finish(_submit(ray_head, args[:-3]))
    assert code == 0 and "already submitted (SUCCEEDED)" in text, text[-3000:]
    assert len(_jobs_on(ray_head)) == 1

    # Another slot of a job whose input is bad: the driver's exit code 2 comes back.
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    bad = _job(tmp_path, random_model_dir, tmp_path / "bad.parquet", "broken", tmp_path / "out-bad")
    code, text = _finish(
        _submit(ray_head, [str(bad), "--address", ray_head.dashboard_url, "--slot", "2024-06-02", "--wait"])
    )
    assert code == 2 and "not a Parquet file" in text, text[-3000:]
