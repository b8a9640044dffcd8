"""The diffusers family: the ditfleet worker vs diffusers' bare pipeline loop on one toy
checkpoint, side by side in one run (CPU time of this process per image), and the actor's
start-up with compile and warm-up per bucket.

The checkpoint is a toy-width random FluxPipeline built here with diffusers' own classes
(ditfleet.testing.diffusers_models; nothing is downloaded). The bare loop calls the pipeline on
the same batches with one generator per image; the worker (workers.actor.GenerationWorker, no
Ray) also encodes every PNG, writes it and commits the shard's manifest to a local folder.

    python bench/diffusers_family.py                        # CPU, compile off (the CPU default)
    python bench/diffusers_family.py --compile              # + the compiled start-up per bucket
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.testing.diffusers_models import make_flux_dir
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import ModelPlacement, WorkerConfig
from ditfleet.workers.rows import RowConfig, ShardSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument(
        "--compile", action="store_true", help="compile blocks and decoder (inductor) at start-up"
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    model = make_flux_dir(tmp / "flux")
    prompts = [
        f"a small {c} {s} on a white background"
        for c in ("red", "blue", "green")
        for s in ("circle", "square")
    ]
    prompts = [prompts[i % len(prompts)] for i in range(args.images)]
    path = tmp / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"b{i:04d}" for i in range(args.images)], "prompt": prompts}), path)
    bucket = f"{args.size}x{args.size}"
    rows = RowConfig(buckets=BucketSet.from_names([bucket]), steps=args.steps, true_cfg_scale=1.0)
    on = bool(args.compile)
    config = WorkerConfig(
        output_uri=str(tmp / "out"),
        rows=rows,
        model_path=str(model),
        placement=ModelPlacement(device="cpu"),
        batch_size=args.batch_size,
        compile=CompileConfig(vae=on, dit=on, shared_cache=False),
    )
    t0 = time.perf_counter()
    worker = GenerationWorker(config)
    startup_s = time.perf_counter() - t0
    pipeline = worker.pipe.pipeline  # the diffusers pipeline itself, for the bare loop

    def bare() -> float:
        t = time.process_time()
        for start in range(0, args.images, args.batch_size):
            part = prompts[start : start + args.batch_size]
            seeds = [7 + start + i for i in range(len(part))]
            pipeline(
                prompt=part, height=args.size, width=args.size, num_inference_steps=args.steps,
                generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt",
            )  # fmt: skip
        return (time.process_time() - t) / args.images

    def job(index: int) -> float:
        t = time.process_time()
        result = worker.run_shard(ShardSpec(index, str(path), 0, args.images, 0, (bucket,), args.images))
        assert result.images_ok == args.images, result
        return (time.process_time() - t) / args.images

    bare()  # both paths warm (allocator, first-call costs) before timing
    bare_s, job_s = bare(), job(0)
    warmup = worker.startup["warmup_s"]
    result = {
        "bench": "diffusers_family",
        "pipeline": worker.pipe.family.name,
        "device": "cpu",
        "size": bucket,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "images": args.images,
        "bare_cpu_s_per_image": round(bare_s, 4),
        "job_cpu_s_per_image": round(job_s, 4),
        "ratio": round(job_s / bare_s, 3),
        "startup_s": round(startup_s, 2),
        "compile": worker.startup["compile"]["status"],
        "warmup_s_per_bucket": warmup,
    }
    print(
        f"{result['pipeline']} at {bucket}, {args.steps} steps, batch {args.batch_size}, {args.images} images"
    )
    print(f"bare diffusers loop : {bare_s * 1000:8.1f} ms CPU per image")
    print(f"ditfleet worker     : {job_s * 1000:8.1f} ms CPU per image   ratio {job_s / bare_s:.3f}")
    print(f"start-up {startup_s:.1f} s; warm-up per bucket {warmup}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
