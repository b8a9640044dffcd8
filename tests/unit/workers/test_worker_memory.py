"""Memory stays flat however large the shard: the real worker path, 100 vs 2,000 images."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.worker_fixtures import write_prompts

CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from tests.support.worker_fixtures import row_config, shard_of, worker_config
    from ditfleet.workers.actor import GenerationWorker

    model, prompts, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = worker_config(model, out, rows=row_config(steps=1, cfg=1.0, buckets=("16x16",)), batch_size=16)
    worker = GenerationWorker(cfg)
    worker.run_shard(shard_of(prompts, 0, 0, 8, buckets=("16x16",)))  # warm the allocator first
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = worker.run_shard(shard_of(prompts, 1, 0, n, buckets=("16x16",)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"ok": result.images_ok, "base_kb": base, "peak_kb": peak}))
    """
)


def _peak(model_dir, prompts, out, n):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(prompts), str(out), str(n)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_of_2000_image_shard_close_to_100(random_model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.parquet", 2000, sizes=False)
    small = _peak(random_model_dir, prompts, tmp_path / "a", 100)
    large = _peak(random_model_dir, prompts, tmp_path / "b", 2000)
    assert small["ok"] == 100 and large["ok"] == 2000
    growth_small = small["peak_kb"] - small["base_kb"]
    growth_large = large["peak_kb"] - large["base_kb"]
    print(
        f"peak RSS: 100 images {small['peak_kb'] / 1024:.1f} MB, 2000 images {large['peak_kb'] / 1024:.1f} MB"
    )
    # Manifest rows (a few hundred bytes each) are the only per-image state that may grow.
    assert large["peak_kb"] <= small["peak_kb"] * 1.05 + 20 * 1024, (small, large, growth_small, growth_large)
