"""Driver at scale: plan a large prompt Parquet (time, peak RSS), printed as one JSON line.

    python bench/driver_scale.py                      # 1,000,000 rows in a temp dir
    python bench/driver_scale.py --rows 200000 --shard-size 256
    python bench/driver_scale.py --input prompts.parquet   # plan an existing file

The generated file has what a real one has: prompts of 40-400 characters, string ids, a third of
the rows with their own seed and size, a pass-through column, and 131,072-row row groups. It is
written in chunks, so generating it does not raise the peak RSS that planning is measured by:
`plan_peak_rss_mb` is the process's peak after planning, `rss_before_plan_mb` the peak before.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.compile.buckets import default_buckets  # noqa: E402
from ditfleet.driver.input.prompts import PromptSource  # noqa: E402
from ditfleet.driver.plan import PlanConfig, plan_job  # noqa: E402
from ditfleet.model.family import QWEN_IMAGE  # noqa: E402
from ditfleet.workers.rows import RowConfig  # noqa: E402

_WORDS = (
    "a photo of red blue small large cat dog city river mountain at night in the morning painted by".split()
)
_SIZES = [(1328, 1328), (1664, 928), (928, 1664), (1024, 768), (800, 1200)]


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_prompts(path: Path, rows: int, chunk: int = 131072) -> None:
    """A prompt Parquet of `rows` rows, written chunk by chunk (one row group per chunk)."""
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        idx = range(start, start + n)
        prompts = [" ".join(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(8 + i % 60)) for i in idx]
        own = [i % 3 == 0 for i in idx]
        table = pa.table(
            {
                "id": [f"img-{i:08d}" for i in idx],
                "prompt": prompts,
                "seed": pa.array(
                    [i * 2654435761 % 2**63 if o else None for i, o in zip(idx, own)], pa.int64()
                ),
                "width": pa.array([_SIZES[i % 5][0] if o else None for i, o in zip(idx, own)], pa.int32()),
                "height": pa.array([_SIZES[i % 5][1] if o else None for i, o in zip(idx, own)], pa.int32()),
                "source": [f"set-{i % 17}" for i in idx],
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--input", help="plan this Parquet file/dir/glob instead of generating one")
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="then dispatch 4,000 shards over 32 simulated actors (bench/driver_dispatch.py): a second JSON line",
    )
    args = parser.parse_args()
    rss_imports = _peak_rss_mb()

    with tempfile.TemporaryDirectory(prefix="ditfleet-bench-") as tmp:
        generate_s = 0.0
        source_uri = args.input
        if source_uri is None:
            source_uri = str(Path(tmp) / "prompts.parquet")
            t0 = time.perf_counter()
            write_prompts(Path(source_uri), args.rows)
            generate_s = time.perf_counter() - t0
        config = PlanConfig(rows=RowConfig(buckets=default_buckets(QWEN_IMAGE)), shard_size=args.shard_size)
        rss_before = _peak_rss_mb()
        t0 = time.perf_counter()
        plan = plan_job(PromptSource(source_uri), config)
        plan_s = time.perf_counter() - t0
        result = {
            "bench": "driver_plan",
            "rows": plan.total_rows,
            "images": plan.total_images,
            "files": len(plan.inputs),
            "shards": len(plan.shards),
            "shard_size": args.shard_size,
            "buckets_used": len(plan.buckets_used),
            "generate_s": round(generate_s, 2),
            "plan_s": round(plan_s, 3),
            "rows_per_s": round(plan.total_rows / plan_s),
            "rss_after_imports_mb": round(rss_imports, 1),
            "rss_before_plan_mb": round(rss_before, 1),
            "plan_peak_rss_mb": round(_peak_rss_mb(), 1),
        }
    print(json.dumps(result), flush=True)
    if args.dispatch:
        from driver_dispatch import run_local  # bench/ is on sys.path when this runs as a script

        print(json.dumps(run_local()), flush=True)


if __name__ == "__main__":
    main()
