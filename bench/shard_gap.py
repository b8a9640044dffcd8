"""The device's wait between two shards, without and with prefetch, side by side in one run.

The real worker (a tiny random Qwen-Image checkpoint on the CPU, real Parquet input, a local
output) runs behind an input store that answers `--latency` seconds late
(ditfleet.testing.slow_input: an object store far away), dispatched on a local Ray by the real
policy, one actor, first with `prefetch` off and then on. The gap is the time from one shard's
last image stored to the next shard's first batch starting on the same actor: without prefetch
it holds the read (and the first batch's encoding); with it, the next shard was prepared while
the one before generated. The images of both runs are compared byte for byte.

    python bench/shard_gap.py                      # 6 shards of 8 rows, 0.5 s per read
    python bench/shard_gap.py --latency 2 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.driver.dispatch import DispatchConfig, run_shards
from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir
from ditfleet.testing.slow_input import SlowInputWorker, read_log, shard_gaps
from ditfleet.workers.contract import WorkerConfig
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import RowConfig, ShardSpec
from ditfleet.workers.storage import open_store


def write_prompts(path: Path, n: int) -> None:
    colours, shapes = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle")
    prompts = [f"a small {colours[i % 4]} {shapes[i % 3]} at the top left" for i in range(n)]
    pq.write_table(pa.table({"id": [f"p{i:05d}" for i in range(n)], "prompt": prompts}), path)


def one_run(model: Path, prompts: Path, work: Path, args: argparse.Namespace, prefetch: bool) -> dict:
    out, log = work / f"out-{prefetch}", work / f"events-{prefetch}.jsonl"
    config = WorkerConfig(
        output_uri=str(out),
        rows=RowConfig(
            job_seed=7, buckets=BucketSet.from_names(("32x32",)), steps=args.steps, true_cfg_scale=4.0
        ),
        model_path=str(model),
        batch_size=4,
        compile=CompileConfig(vae=False, dit=False),
        writer=ShardWriterConfig(threads=2),
    )
    rows = args.rows
    shards = [
        ShardSpec(i, str(prompts), i * rows, (i + 1) * rows, i * rows, ("32x32",), rows)
        for i in range(args.shards)
    ]
    dispatch = DispatchConfig(
        min_actors=1, max_actors=1, num_cpus=1, speculative_tail=False, tick_s=0.1, prefetch=prefetch
    )
    t0 = time.perf_counter()
    result = run_shards(shards, SlowInputWorker, (config, args.latency, str(log)), dispatch)
    wall = time.perf_counter() - t0
    assert not result.failed and len(result.results) == args.shards, result.failed
    gaps = shard_gaps(read_log(log))
    table = read_manifests(open_store(str(out))).to_pandas()
    return {
        "gap_median_s": round(statistics.median(gaps), 3),
        "gap_max_s": round(max(gaps), 3),
        "input_wait_s": round(sum(r.input_wait_s for r in result.results), 3),
        "prefetched_shards": sum(r.prefetched for r in result.results),
        "generate_s": round(sum(r.generate_s for r in result.results), 3),
        "dispatch_wall_s": round(wall, 2),
        "images": dict(zip(table["id"] + "/" + table["k"].astype(str), table["sha256"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds each shard's read waits")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shard-gap-"))
    model = add_tiny_text_encoder(make_diffusers_model_dir(work / "model"))
    prompts = work / "prompts.parquet"
    write_prompts(prompts, args.shards * args.rows)
    # A single-node cluster on loopback (see tests/support/fixtures_ray.py for why the variable).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        runs = {
            name: one_run(model, prompts, work, args, prefetch)
            for name, prefetch in (("off", False), ("on", True))
        }
    finally:
        ray.shutdown()
    identical = runs["off"].pop("images") == runs["on"].pop("images")
    print(
        f"{args.shards} shards x {args.rows} rows, {args.steps} steps, reads {args.latency} s late; one actor"
    )
    print(
        f"{'prefetch':>9} {'gap median':>11} {'gap max':>8} {'input wait':>11} {'prefetched':>11} {'wall':>7}"
    )
    for name, r in runs.items():
        print(
            f"{name:>9} {r['gap_median_s']:>10.3f}s {r['gap_max_s']:>7.3f}s {r['input_wait_s']:>10.3f}s "
            f"{r['prefetched_shards']:>11} {r['dispatch_wall_s']:>6.1f}s"
        )
    print(f"images byte-identical: {identical}")
    line = {"bench": "shard_gap", **vars(args), "off": runs["off"], "on": runs["on"], "identical": identical}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
