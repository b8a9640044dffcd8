"""bench/gpu_realsize.py runs end to end on the CPU at one block and 256x256 (its smoke test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

REPO = REPO


@pytest.mark.slow
def test_gpu_realsize_bench_smoke_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "bench" / "gpu_realsize.py"), "--layers", "1", "--size", "256",
           "--device", "cpu", "--repeat", "3", "--workdir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["layers"] == 1 and result["dtype"] == "bf16" and result["peak_gpu_gb"] is None
    # One published-width block in bf16: 339.8M parameters, plus embedders and output layers.
    assert 0.7 < result["dit_weights_gb"] < 0.8
    size = result["sizes"]["256x256"]
    for key in ("dit_forward_ms", "cfg_step_ms", "vae_decode_eager_ms", "images_per_hour", "plan_peak_gb"):
        assert size[key] > 0, key
    assert size["cfg_step_ms"] > size["dit_forward_ms"]  # two forwards
    assert size["vae_decode_compiled_ms"] is None  # compile is for CUDA unless asked
    assert (
        tmp_path / "qwen-image" / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    ).is_file()
