"""Resume at 400,000 shards: what a rerun reads before it dispatches, printed as one JSON line.

    python bench/resume_scale.py                     # 400,000 committed shards
    python bench/resume_scale.py --shards 40000

- `list_committed_s`: `committed_shards(store)` over a local output holding that many shard
  manifests: one listing of manifests/, no manifest opened (their content is never read here;
  the files are empty);
- `plan_file_mb`, `plan_write_s`, `plan_read_s`: the plan of that many shards as `_plan.parquet`
  (driver/plan_file.py), written and read back into a JobPlan, instead of scanning the input again.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.compile.buckets import default_buckets  # noqa: E402
from ditfleet.driver.plan import InputIdentity, JobPlan, PlanConfig  # noqa: E402
from ditfleet.driver.plan_file import plan_from_table, plan_table  # noqa: E402
from ditfleet.workers.output.layout import manifest_key  # noqa: E402
from ditfleet.workers.output.manifest import committed_shards  # noqa: E402
from ditfleet.workers.rows import RowConfig, ShardSpec  # noqa: E402
from ditfleet.workers.storage import open_store  # noqa: E402
from ditfleet.workers.storage.parquet_bytes import read_parquet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=400_000)
    parser.add_argument(
        "--files", type=int, default=100, help="input files the plan's shards are spread over"
    )
    parser.add_argument(
        "--list-shards",
        type=int,
        help="manifests in the listed output (default --shards; files are slow to make)",
    )
    args = parser.parse_args()
    n = args.shards
    listed = args.list_shards or n
    with tempfile.TemporaryDirectory(prefix="ditfleet-resume-") as tmp:
        t0 = time.perf_counter()
        (Path(tmp) / "manifests").mkdir()
        for s in range(listed):
            open(os.path.join(tmp, manifest_key(s)), "wb").close()
        make_s = time.perf_counter() - t0
        store = open_store(tmp)
        t0 = time.perf_counter()
        committed = committed_shards(store)
        list_s = time.perf_counter() - t0
        assert len(committed) == listed

    config = PlanConfig(rows=RowConfig(buckets=default_buckets("Qwen/Qwen-Image")), shard_size=250)
    names = config.rows.buckets.names
    per_file = -(-n // args.files)
    uris = [f"s3://bucket/prompts/part-{f:05d}.parquet" for f in range(args.files)]
    shards = tuple(
        ShardSpec(
            i,
            uris[i // per_file],
            (i % per_file) * 250,
            (i % per_file + 1) * 250,
            i * 250,
            (names[i % 3],),
            250,
        )
        for i in range(n)
    )
    inputs = tuple(InputIdentity(u, 1 << 30, per_file * 250, "0" * 64) for u in uris)
    plan = JobPlan(config, "s3://bucket/prompts", inputs, shards, n * 250, n * 250, tuple(names[:3]))
    t0, c0 = time.perf_counter(), time.process_time()
    sink = io.BytesIO()
    pq.write_table(plan_table(plan), sink, compression="zstd")
    write_s, write_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    loaded = plan_from_table(read_parquet(sink.getvalue()), config)
    read_s, read_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    assert loaded.shards == plan.shards and loaded.fingerprint() == plan.fingerprint()
    print(
        json.dumps(
            {
                "bench": "resume_scale",
                "shards": n,
                "listed_manifests": listed,
                "make_manifests_s": round(make_s, 1),
                "list_committed_s": round(list_s, 3),
                "plan_file_mb": round(len(sink.getvalue()) / 2**20, 2),
                "plan_file_bytes_per_shard": round(len(sink.getvalue()) / n, 1),
                "plan_write_s": round(write_s, 3),
                "plan_read_s": round(read_s, 3),
                "plan_write_cpu_s": round(write_cpu_s, 3),
                "plan_read_cpu_s": round(read_cpu_s, 3),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
