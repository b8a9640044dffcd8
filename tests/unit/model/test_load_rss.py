"""Loading streams shard by shard: host memory held beyond the model stays under 1.3x the largest
shard (bench/load_rss.py on the real-widths checkpoint, each load in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

BENCH = REPO / "bench" / "load_rss.py"


def _bench(model_dir: Path, dtype: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(model_dir), "--dtype", dtype],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_streaming_load_holds_less_than_one_shard_beyond_the_model(real_widths_dir, dtype):
    r = _bench(real_widths_dir, dtype)
    assert r["shards"] >= 3
    assert r["streaming_ratio"] < 1.3, r
    if dtype == "fp32":
        # The measurement sees a loader that does not stream: reading every shard first and
        # casting after holds the whole bf16 checkpoint at once (in bf16 on the CPU, the
        # memory-mapped shards are themselves the model, so both cost the same there).
        assert r["whole_ratio"] > 2.0, r
