"""bench/dit_forward.py runs end to end, tiny: ours eager, compiled (Dynamo's eager backend) and
diffusers on the same weights, with every number of its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO

ROOT = REPO


def test_dit_forward_bench_smoke():
    cmd = [sys.executable, "bench/dit_forward.py", "--layers", "1", "--heads", "2", "--size", "32",
           "--text-tokens", "4", "--rounds", "1", "--compile-backend", "eager"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    row = report["results"]["32x32"]
    assert report["widths"] == {"hidden": 256, "heads": 2, "text_dim": 298}
    # On CPU in fp32 the compiled DiT also runs with aten's linears (the before of oneDNN's).
    assert set(row["ms_per_forward"]) == {
        "ours_eager", "ours_compiled", "ours_compiled_aten_linear", "diffusers_eager"
    }  # fmt: skip
    assert row["speedup_ours_compiled_aten_linear_vs_diffusers"] > 0
    assert set(row["ms_per_cfg_step"]) == {"off", "cfg", "table"}
    assert set(row["padded_attention_ms"]) == {"dense_mask", "unmasked", "split"}
    assert 0 <= row["attention_share_eager"] <= 1 and row["speedup_ours_compiled_vs_diffusers"] > 0


def test_dit_forward_elementwise_smoke():
    cmd = [sys.executable, "bench/dit_forward.py", "--elementwise-only", "--heads", "2", "--size", "32",
           "--text-tokens", "4", "--rounds", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 4 + 4
    assert set(report["ms"]) == {"rms_norm_rope", "layer_norm_modulate", "gate_residual"}
