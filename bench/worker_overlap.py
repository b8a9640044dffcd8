"""Worker throughput vs the bare pipeline loop on the same batches, side by side in one run.

The bare loop only generates (the upper bound); the worker also encodes every image and uploads it
to a real S3 endpoint (a moto server on 127.0.0.1), writes the manifest and commits. With encode
and upload overlapped on the worker's thread pool the ratio should be close to 1.

    python bench/worker_overlap.py                       # bundled tiny model, CPU
    python bench/worker_overlap.py --model /path/to/qwen-image --device cuda --size 1328
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import ModelPlacement, WorkerConfig
from ditfleet.workers.generate import image_requests, iter_generated, plan_batches
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.rows import RowConfig, ShardSpec, read_shard_rows
from ditfleet.workers.storage import S3Config
from ditfleet.workers.storage.input_files import filesystem_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"S3 endpoint {host}:{port} did not come up in {timeout_s}s")


def write_prompts(path: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    colours, shapes = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle")
    prompts = [
        f"a small {colours[i % 4]} {shapes[i % 3]} at the centre on a white background" for i in range(n)
    ]
    pq.write_table(pa.table({"id": [f"b{i:05d}" for i in range(n)], "prompt": prompts}), path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # The S3 endpoint runs in its own process, as a real one would, so it does not share this
    # process's GIL with the generation loop.
    host, port = "127.0.0.1", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(host, port)
    s3 = S3Config(endpoint_url=f"http://{host}:{port}", region="us-east-1", addressing_style="path")
    from ditfleet.workers.storage.s3 import make_s3_client

    make_s3_client(s3).create_bucket(Bucket="bench")
    tmp = Path(tempfile.mkdtemp())
    prompts = tmp / "prompts.parquet"
    write_prompts(prompts, args.images)
    bucket = f"{args.size}x{args.size}"
    rows_cfg = RowConfig(buckets=BucketSet.from_names([bucket]), steps=args.steps, true_cfg_scale=4.0)
    cfg = WorkerConfig(
        output_uri="s3://bench/out",
        rows=rows_cfg,
        model_path=args.model,
        placement=ModelPlacement(device=args.device),
        batch_size=args.batch_size,
        compile=CompileConfig(vae=False, dit=False),
        writer=ShardWriterConfig(threads=4, max_in_flight=2 * args.batch_size),
        s3=s3,
    )
    worker = GenerationWorker(cfg)
    sync = torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None)

    def shard(i: int) -> ShardSpec:
        return ShardSpec(i, str(prompts), 0, args.images, 0, (bucket,), args.images)

    def bare(i: int) -> float:
        rows = read_shard_rows(shard(i), filesystem_for(str(prompts)), rows_cfg)
        batches = plan_batches(image_requests(rows), args.batch_size)
        sync()
        t0 = time.perf_counter()
        n = sum(1 for _ in iter_generated(worker.generator, batches))
        sync()
        return n / (time.perf_counter() - t0)

    stages: list[dict] = []

    def full(i: int) -> float:
        t0 = time.perf_counter()
        r = worker.run_shard(shard(i), attempt=0)
        dt = time.perf_counter() - t0
        assert r.images_ok == args.images, r
        stages.append(
            {"generate_s": r.generate_s, "encode_s": r.encode_s, "upload_s": r.upload_s, "wall_s": dt}
        )
        return args.images / dt

    bare(0)  # warm-up
    bare_ips, worker_ips = [], []
    for i in range(args.rounds):
        bare_ips.append(bare(i))
        worker_ips.append(full(100 + i))
    server.terminate()
    server.wait(timeout=30)
    b, w = statistics.median(bare_ips), statistics.median(worker_ips)
    st = {k: round(statistics.median(s[k] for s in stages), 3) for k in stages[0]}
    result = {
        "bench": "worker_overlap",
        "device": str(worker.device),
        "model": args.model,
        "size": args.size,
        "images_per_round": args.images,
        "bare_images_per_s": round(b, 3),
        "worker_images_per_s": round(w, 3),
        "ratio": round(w / b, 3),
        "stage_seconds_per_shard": st,
    }
    print(f"bare pipeline loop : {b:8.2f} images/s")
    print(f"worker (S3 upload) : {w:8.2f} images/s   ratio {w / b:.3f}")
    print(
        f"per shard: generate {st['generate_s']}s, encode {st['encode_s']}s, upload {st['upload_s']}s (summed over threads), wall {st['wall_s']}s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
