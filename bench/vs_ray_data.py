"""ditfleet vs what users write instead (Ray Data `map_batches` + diffusers), side by side in one run.

Both run on the same local Ray, the same diffusers-format weights, prompts, buckets, steps, CFG
and seeds, and write to the same S3 endpoint (a moto server on 127.0.0.1):

- ditfleet: `ditfleet run job.yaml --address <this Ray>` (output format "parquet" by default:
  images embedded in one file per shard, plus manifests; --ditfleet-format files for one object
  per image);
- baseline: bench/ray_data_baseline.py, written the way Ray's docs teach (callable class holding a
  diffusers QwenImagePipeline, `map_batches` on an actor pool, `write_parquet` of PNG bytes with
  their metadata).

Each path runs clean --rounds times, in alternating order (throughput, time to first image, CPU,
memory; the median round is shown), and, unless --no-kill, once more with one busy actor
SIGKILLed when half the images are stored (rows lost, rows duplicated, work redone). The clean
outputs are decoded and compared pixel by pixel. Unless --no-profile, an in-process profile
(bench/pipeline_profile.py) then splits one batch's time into text encoding, denoising and VAE
decode for both pipelines. bench/README.md explains every row.

    python bench/vs_ray_data.py                          # CPU: 96 images, 128x128 + 160x96, 8 steps
    python bench/vs_ray_data.py --images 16 --steps 2 --rounds 1 --no-kill --no-profile   # smoke
    python bench/vs_ray_data.py --device cuda --actors 1 --gpus-per-actor 1 --compile-vae \\
        --model /models/Qwen-Image --buckets 1328x1328 --steps 20 --images 32 --batch-size 4 \\
        --shard-size 8 --rows-per-block 8

Prints a table, then one JSON line. Absolute times only count on a GPU; on a shared CPU the
ratios, and CPU time rather than wall time, are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.run_watch import RunWatch, run_driver  # noqa: E402
from bench.vs_ray_data_io import (  # noqa: E402
    BENCH_BUCKET,
    baseline_outputs,
    compare_images,
    ditfleet_outputs,
    ditfleet_stored_counter,
    parquet_rows_counter,
    prepare_model,
    start_s3,
    stop_s3,
    write_prompts,
)
from bench.vs_ray_data_report import format_table  # noqa: E402

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="auto", help="auto (bundled tiny if trained, else random) | random | PATH"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--buckets", default="128x128,160x96", help="rows cycle through these sizes")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--true-cfg-scale", type=float, default=4.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--gpus-per-actor", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shard-size", type=int, default=16, help="ditfleet rows per shard")
    ap.add_argument("--rows-per-block", type=int, default=16, help="baseline rows per Ray Data block")
    ap.add_argument(
        "--ditfleet-format",
        default="parquet",
        choices=["parquet", "files"],
        help="parquet: images embedded in one file per shard, like the baseline's write_parquet; "
        "files: one object per image",
    )
    ap.add_argument("--compile-vae", action="store_true", help="ditfleet compiles the VAE decode (GPU)")
    ap.add_argument("--modulation-cache", default="cfg", choices=["off", "cfg", "table"])
    ap.add_argument("--rounds", type=int, default=3, help="clean runs of each path (the median is shown)")
    ap.add_argument("--no-kill", action="store_true", help="skip the runs with one actor killed")
    ap.add_argument("--no-profile", action="store_true", help="skip the in-process pipeline profile")
    ap.add_argument("--timeout-s", type=float, default=300, help="per driver run")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, model, prompts)")
    return ap.parse_args(argv)


def start_ray(args: argparse.Namespace, temp_dir: Path) -> str:
    """A local Ray on 127.0.0.1 that both drivers connect to; returns its GCS address."""
    import ray

    # One logical CPU per actor, plus room for Ray Data's read and write tasks.
    ray.init(
        num_cpus=args.actors + 2,
        num_gpus=None if args.device == "cuda" else 0,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=512 * 1024 * 1024,
        logging_level="WARNING",
        log_to_driver=False,  # each driver's log has its own actors' output
        _temp_dir=str(temp_dir),
    )
    return ray.get_runtime_context().gcs_address


def ditfleet_job(args: argparse.Namespace, ctx: dict[str, Any], prefix: str) -> Path:
    import yaml

    job = {
        "name": f"bench-{prefix}",
        "input": {"path": str(ctx["prompts"])},
        "output": {
            "uri": f"s3://{BENCH_BUCKET}/{prefix}",
            "format": args.ditfleet_format,
            "image_format": "png",
            # No provenance in the files: it names each round's job (bench-<prefix>), so rounds
            # would differ in bytes where their pixels agree, and the baseline writes none. Off,
            # "same PNG bytes in every round" compares what it says.
            "embed_metadata": False,
        },
        "model": {
            "path": str(ctx["model_dir"]),
            "device": args.device,
            "modulation_cache": args.modulation_cache,
        },
        "sampling": {"steps": args.steps, "true_cfg_scale": args.true_cfg_scale, "negative_prompt": " "},
        "buckets": {"names": args.buckets.split(","), "strict": True},
        "compile": {"vae": args.compile_vae, "dit": False},
        "workers": {
            "min": args.actors,
            "max": args.actors,
            "gpus": args.gpus_per_actor,
            "cpus": 1,
            "batch_size": args.batch_size,
            "idle_retire_s": 2,
        },
        "shards": {"size": args.shard_size},
        "s3": {"endpoint_url": ctx["endpoint"], "region": "us-east-1", "addressing_style": "path"},
    }
    path = ctx["tmp"] / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def driver_command(args: argparse.Namespace, ctx: dict[str, Any], path: str, prefix: str) -> list[str]:
    if path == "ditfleet":
        job = ditfleet_job(args, ctx, prefix)
        return [sys.executable, "-m", "ditfleet.jobs.cli", "run", str(job), "--address", ctx["gcs"]]
    log_dir = ctx["tmp"] / f"{prefix}-udf"
    log_dir.mkdir()
    return [
        *(sys.executable, str(REPO / "bench" / "ray_data_baseline.py"), "--address", ctx["gcs"]),
        *("--prompts", str(ctx["prompts"]), "--model", str(ctx["model_dir"])),
        *("--output", f"s3://{BENCH_BUCKET}/{prefix}", "--endpoint-url", ctx["endpoint"]),
        *("--steps", str(args.steps), "--true-cfg-scale", str(args.true_cfg_scale)),
        *("--concurrency", str(args.actors), "--batch-size", str(args.batch_size)),
        *("--rows-per-block", str(args.rows_per_block), "--num-gpus", str(args.gpus_per_actor)),
        *("--log-dir", str(log_dir)),
    ]


def run_path(
    args: argparse.Namespace, ctx: dict[str, Any], path: str, prefix: str, kill: bool
) -> dict[str, Any]:
    """One driver run of `path` ("ditfleet" | "ray_data") into s3://bench/{prefix}, watched
    from outside; then its output counted per id."""
    n, client = args.images, ctx["client"]
    cmd = driver_command(args, ctx, path, prefix)
    if path == "ditfleet":
        counter = ditfleet_stored_counter(client, prefix, args.ditfleet_format)
        marker, method = "GenerationWorker", "run_shard"
    else:
        counter, marker, method = parquet_rows_counter(client, f"{prefix}/"), "MapWorker", "submit"
    watch = RunWatch(
        counter, n, marker, method, kill_at_fraction=0.5 if kill else None, exclude=(ctx["s3_pid"],)
    )
    watch.start()

    def started(pid: int) -> None:
        watch.driver_pid = pid

    run = run_driver(cmd, ctx["env"], REPO, ctx["tmp"] / f"{prefix}.log", args.timeout_s, started)
    seen = watch.stop()
    if run.returncode != 0:
        tail = run.log.read_text(errors="replace")[-3000:]
        print(
            f"--- {prefix}: driver exited with {run.returncode}; end of {run.log}:\n{tail}", file=sys.stderr
        )
    if path == "ditfleet":
        out = ditfleet_outputs(client, prefix, n, args.ditfleet_format)
    else:
        out = baseline_outputs(client, prefix, n, ctx["tmp"] / f"{prefix}-udf")
    first = seen.first_image_at
    steady = None
    if first is not None and seen.all_images_at is not None and seen.all_images_at > first:
        steady = (n - seen.first_count) / (seen.all_images_at - first)
    actor_cpu = sum(seen.actor_cpu_s.values())
    startup_cpu = sum(seen.actor_startup_cpu_s.values())
    total_cpu = actor_cpu + seen.other_cpu_s + run.cpu_s
    stored = max(out["images_stored"], 1)
    result = {
        "path": path,
        "prefix": prefix,
        "kill": kill,
        "returncode": run.returncode,
        "wall_s": round(run.wall_s, 2),
        "images_per_s_job": round(out["images_stored"] / run.wall_s, 3),
        "images_per_s_first_to_last": round(steady, 3) if steady else None,
        "first_image_s": round(first - run.started_at, 2) if first else None,
        "driver_peak_rss_mb": round(run.peak_rss_mb, 1),
        "actor_peak_rss_mb": round(max(seen.actor_peak_rss_mb.values(), default=0.0), 1),
        "actors_seen": len(seen.actor_peak_rss_mb),
        "cpu_s": {
            "driver": round(run.cpu_s, 2),
            "actors": round(actor_cpu, 2),
            "actor_startup": round(startup_cpu, 2),
            "ray_other": round(seen.other_cpu_s, 2),
            "total": round(total_cpu, 2),
        },
        "actor_cpu_ms_per_image": round(1000 * actor_cpu / stored, 1),
        # Serving only (start-up left out): what bounds throughput once actors are up.
        "serving_cpu_ms_per_image": round(1000 * (actor_cpu - startup_cpu) / stored, 1),
        "actor_startup_cpu_s": round(startup_cpu / max(len(seen.actor_startup_cpu_s), 1), 2),
        "total_cpu_ms_per_image": round(1000 * total_cpu / stored, 1),
        "actor_titles": sorted(seen.titles),
        "watch_errors": watch.errors[:3],
        "log": str(run.log),
        **{k: v for k, v in out.items() if k != "images"},
    }
    if kill:
        result["killed_pid"] = seen.killed_pid
        result["stored_at_kill"] = seen.stored_at_kill
    result["_images"] = out["images"]  # id -> PNG bytes, for the comparison; not in the JSON
    return result


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round by wall time (the faster middle one for an even count): one real run,
    neither the luckiest nor the unluckiest on a shared machine."""
    ranked = sorted(rounds, key=lambda r: (r["returncode"] != 0, r["wall_s"]))
    return ranked[(len(ranked) - 1) // 2]


def identical_across_rounds(rounds: list[dict[str, Any]]) -> bool | None:
    """Every round stored the same PNG bytes for every id (None with one round)."""
    if len(rounds) < 2:
        return None
    first = rounds[0]["_images"]
    return all(r["_images"] == first for r in rounds[1:])


def run_all(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """Clean rounds in alternating order (ditfleet first, then the baseline first, ...), then
    the kill runs; returns the runs by name, every clean round's key numbers, and the image
    comparison."""
    rounds: dict[str, list[dict[str, Any]]] = {"ditfleet": [], "ray_data": []}
    for i in range(args.rounds):
        order = ("ditfleet", "ray_data") if i % 2 == 0 else ("ray_data", "ditfleet")
        for path in order:
            rounds[path].append(run_path(args, ctx, path, f"{path}-clean{i}", kill=False))
    runs = {f"{path}-clean": median_round(rs) for path, rs in rounds.items()}
    if not args.no_kill:
        for path in ("ditfleet", "ray_data"):
            runs[f"{path}-kill"] = run_path(args, ctx, path, f"{path}-kill", kill=True)
    identity = compare_images(runs["ditfleet-clean"]["_images"], runs["ray_data-clean"]["_images"])
    for path, rs in rounds.items():
        identity[f"{path}_rounds_bit_identical"] = identical_across_rounds(rs)
    for r in [*runs.values(), *(r for rs in rounds.values() for r in rs)]:
        r.pop("_images", None)
    keys = ("wall_s", "first_image_s", "serving_cpu_ms_per_image", "total_cpu_ms_per_image")
    summary = {path: {k: [r[k] for r in rs] for k in keys} for path, rs in rounds.items()}
    return {"runs": runs, "rounds": summary, "identity": identity}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vs-ray-data-"))
    os.environ.update(
        {**LOOPBACK_ENV, **CREDENTIALS, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    )
    # Ray workers inherit this environment: the repository on their path, for both drivers' code.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    server = None
    try:
        model_dir, model_name = prepare_model(args.model, tmp)
        write_prompts(tmp / "prompts.parquet", args.images, args.buckets.split(","))
        server, endpoint, client = start_s3(tmp)
        ctx = {
            "tmp": tmp,
            "model_dir": model_dir,
            "prompts": tmp / "prompts.parquet",
            "endpoint": endpoint,
            "client": client,
            "s3_pid": server.pid,
            "gcs": start_ray(args, tmp / "ray"),
            "env": dict(os.environ),
        }
        measured = run_all(args, ctx)
        profile = None
        if not args.no_profile:
            from bench.pipeline_profile import profile_pipelines

            bucket = args.buckets.split(",")[0]
            profile = profile_pipelines(
                model_dir, bucket, args.steps, args.true_cfg_scale, args.batch_size, args.device
            )
        result = {
            "bench": "vs_ray_data",
            "device": args.device,
            "model": model_name,
            "images": args.images,
            "buckets": args.buckets,
            "steps": args.steps,
            "true_cfg_scale": args.true_cfg_scale,
            "actors": args.actors,
            "batch_size": args.batch_size,
            "ditfleet_format": args.ditfleet_format,
            **measured,
            "profile": profile,
        }
        print(format_table(result))
        print(json.dumps(result))
        return result
    finally:
        _shutdown_ray()
        if server is not None:
            stop_s3(server)
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    main()
