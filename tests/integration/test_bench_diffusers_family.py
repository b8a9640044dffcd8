"""bench/diffusers_family.py runs end to end, tiny: every family's row (the diffusers family's
FluxPipeline and StableDiffusion3Pipeline, the native Qwen-Image at true CFG and at the few-step
no-CFG schedule, the native edit model) with every number of its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

ROW_KEYS = {
    "pipeline", "family", "size", "steps", "true_cfg_scale", "batch_size", "images", "bare_cpu_s_per_image",
    "job_cpu_s_per_image", "ratio", "startup_s", "compile", "warmup_s_per_bucket",
}  # fmt: skip


@pytest.mark.slow
def test_diffusers_family_bench_smoke():
    # The edit row at the published source areas costs seconds per image on a CPU: one image.
    cmd = [sys.executable, "bench/diffusers_family.py", "--images", "1", "--batch-size", "1",
           "--steps", "1", "--size", "32"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["pipeline"]: r for r in report["results"]}
    assert list(rows) == ["flux", "sd3", "qwen-image", "qwen-image-flash", "qwen-image-edit"]
    assert {r["family"] for r in rows.values()} == {
        "diffusers:FluxPipeline", "diffusers:StableDiffusion3Pipeline", "qwen-image"
    }  # fmt: skip
    for row in rows.values():
        assert set(row) == ROW_KEYS
        assert row["bare_cpu_s_per_image"] > 0 and row["job_cpu_s_per_image"] > 0 and row["ratio"] > 0
    # the few-step row is the distilled checkpoints' schedule whatever --steps says: 4 steps, CFG off
    assert (rows["qwen-image-flash"]["steps"], rows["qwen-image-flash"]["true_cfg_scale"]) == (4, 1.0)
    assert rows["qwen-image"]["true_cfg_scale"] > 1 and rows["qwen-image-edit"]["images"] == 1


def test_an_unknown_pipeline_is_refused_naming_the_choices():
    cmd = [sys.executable, "bench/diffusers_family.py", "--pipeline", "flux,sdxl"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown ['sdxl']" in out.stderr and "qwen-image-edit" in out.stderr
