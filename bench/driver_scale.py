"""Driver at scale: plan a large prompt Parquet (time, peak RSS), printed as one JSON line.

    python bench/driver_scale.py                      # 1,000,000 rows in a temp dir
    python bench/driver_scale.py --rows 200000 --shard-size 256
    python bench/driver_scale.py --input prompts.parquet   # plan an existing file
    python bench/driver_scale.py --rows 10000000 --files 10 --workers 1 2   # side by side
    python bench/driver_scale.py --rows 100000000 --files 100 --dir /tmp/p100m   # keeps the input

The generated file has what a real one has: prompts of 40-400 characters, string ids, a third of
the rows with their own seed and size, a pass-through column, and 131,072-row row groups. It is
written in chunks, so generating it does not raise the peak RSS that planning is measured by:
`plan_peak_rss_mb` is the process's peak after planning, `rss_before_plan_mb` the peak before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.compile.buckets import default_buckets  # noqa: E402
from ditfleet.driver.input.prompts import PromptSource  # noqa: E402
from ditfleet.driver.plan import PLAN_WORKERS, PlanConfig, plan_job  # noqa: E402
from ditfleet.model.qwen_image.family import QWEN_IMAGE  # noqa: E402
from ditfleet.workers.rows import RowConfig  # noqa: E402

_WORDS = (
    "a photo of red blue small large cat dog city river mountain at night in the morning painted by".split()
)
_SIZES = [(1328, 1328), (1664, 928), (928, 1664), (1024, 768), (800, 1200)]


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_prompts(path: Path, rows: int, chunk: int = 131072, first: int = 0) -> None:
    """A prompt Parquet of `rows` rows, written chunk by chunk (one row group per chunk); ids
    and seeds continue from row `first` (several files make one input)."""
    writer = None
    base = _base_prompts(chunk)
    for start in range(first, first + rows, chunk):
        n = min(chunk, first + rows - start)
        i = np.arange(start, start + n, dtype=np.int64)
        own = i % 3 == 0
        ids = pc.binary_join_element_wise("img-", pc.utf8_lpad(pa.array(i).cast(pa.string()), 9, "0"), "")
        # Every prompt distinct (the chunk's pool, rotated, and its row number): Parquet stores
        # them plain, as real captions are, not as a small dictionary.
        prompts = pc.binary_join_element_wise(
            base.take(pa.array((i * 7919) % chunk)), pa.array(i).cast(pa.string()), " #"
        )
        size = i % 5
        table = pa.table(
            {
                "id": ids,
                "prompt": prompts,
                "seed": pa.array(
                    np.where(own, (i * 2654435761) & np.int64(2**62 - 1), 0), pa.int64(), mask=~own
                ),
                "width": pa.array(_W[size], pa.int32(), mask=~own),
                "height": pa.array(_H[size], pa.int32(), mask=~own),
                "source": pc.binary_join_element_wise("set-", pa.array(i % 17).cast(pa.string()), ""),
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


_W = np.array([w for w, _ in _SIZES], np.int32)
_H = np.array([h for _, h in _SIZES], np.int32)


def _base_prompts(n: int) -> pa.Array:
    """n prompts of 40-400 characters (8-67 words)."""
    return pa.array(" ".join(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(8 + i % 60)) for i in range(n))


def write_input(directory: Path, rows: int, files: int) -> str:
    """`rows` rows over `files` files part-00000.parquet, ... (a directory input)."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    for f in range(files):
        first = f * per_file
        if first < rows:
            write_prompts(directory / f"part-{f:05d}.parquet", min(per_file, rows - first), first=first)
    return str(directory) if files > 1 else str(directory / "part-00000.parquet")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plan_once(source_uri: str, shard_size: int, workers: int, generate_s: float = 0.0) -> dict:
    rss_imports = _peak_rss_mb()
    config = PlanConfig(rows=RowConfig(buckets=default_buckets(QWEN_IMAGE)), shard_size=shard_size)
    rss_before = _peak_rss_mb()
    cpu0, t0 = _cpu_s(), time.perf_counter()
    plan = plan_job(PromptSource(source_uri), config, workers=workers)
    plan_s, cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
    return {
        "bench": "driver_plan",
        "rows": plan.total_rows,
        "images": plan.total_images,
        "files": len(plan.inputs),
        "shards": len(plan.shards),
        "shard_size": shard_size,
        "workers": workers,
        "buckets_used": len(plan.buckets_used),
        "generate_s": round(generate_s, 2),
        "plan_s": round(plan_s, 3),
        "plan_cpu_s": round(cpu_s, 2),
        "rows_per_s": round(plan.total_rows / plan_s),
        "rss_after_imports_mb": round(rss_imports, 1),
        "rss_before_plan_mb": round(rss_before, 1),
        "plan_peak_rss_mb": round(_peak_rss_mb(), 1),
        # The machine is shared: the load says how far wall times are from an idle one's.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=1, help="spread the generated rows over this many files")
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--input", help="plan this Parquet file/dir/glob instead of generating one")
    parser.add_argument("--dir", help="generate the input here and keep it (reused when it is there)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[PLAN_WORKERS],
        help="threads scanning files; several values: each planned in its own process (its own peak RSS)",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="then dispatch 4,000 shards over 32 simulated actors (bench/driver_dispatch.py): a second JSON line",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="ditfleet-bench-") as tmp:
        generate_s = 0.0
        source_uri = args.input
        if source_uri is None:
            directory = Path(args.dir) if args.dir else Path(tmp)
            marker = directory / "_rows"
            if args.dir and marker.exists() and marker.read_text() == f"{args.rows} {args.files}":
                source_uri = str(directory) if args.files > 1 else str(directory / "part-00000.parquet")
            else:
                t0 = time.perf_counter()
                source_uri = write_input(directory, args.rows, args.files)
                generate_s = time.perf_counter() - t0
                marker.write_text(f"{args.rows} {args.files}")
        if len(args.workers) == 1:
            print(json.dumps(plan_once(source_uri, args.shard_size, args.workers[0], generate_s)), flush=True)
        else:
            for workers in args.workers:
                command = [
                    sys.executable,
                    __file__,
                    "--input",
                    source_uri,
                    "--shard-size",
                    str(args.shard_size),
                ]
                out = subprocess.run(
                    command + ["--workers", str(workers)], capture_output=True, text=True, check=True
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                result["generate_s"] = round(generate_s, 2)
                print(json.dumps(result), flush=True)
    if args.dispatch:
        from driver_dispatch import run_local  # bench/ is on sys.path when this runs as a script

        print(json.dumps(run_local()), flush=True)


if __name__ == "__main__":
    main()
