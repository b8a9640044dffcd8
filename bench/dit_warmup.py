"""Warm-up of the bundled tiny model with the DiT compiled: graphs compiled and seconds.

Run it in a fresh process with an empty Inductor cache (set TORCHINDUCTOR_CACHE_DIR to a new
folder), or the numbers measure cache hits. CPU seconds include the C++ compiler's child
processes. Compare two checkouts by running it from each.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_COMPILE_THREADS=1 \\
        python bench/dit_warmup.py --bucket 128x128 --batch-sizes 2 --max-sequence-length 64
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from ditfleet.compile import CompileConfig, WarmupRuns, apply_compile, warm_up
from ditfleet.model import load_pipeline


def cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket", action="append", help="WxH; repeatable (default 128x128)")
    ap.add_argument("--batch-sizes", default="2", help="comma-separated")
    ap.add_argument("--max-sequence-length", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipe = load_pipeline("tiny")
    apply_compile(pipe, CompileConfig(vae=True, dit=True))
    start = cpu_seconds()
    runs = WarmupRuns(
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        max_sequence_length=args.max_sequence_length,
    )
    warm = warm_up(pipe, args.bucket or ["128x128"], runs)
    print(
        json.dumps(
            {
                "bench": "dit_warmup",
                "buckets": [b.bucket for b in warm.buckets],
                "batch_sizes": list(warm.batch_sizes),
                "graphs": warm.compiles,
                "seconds": round(warm.seconds, 1),
                "cpu_s_with_compiler": round(cpu_seconds() - start, 1),
                "text_lengths": list(warm.prompt_lengths),
            }
        )
    )


if __name__ == "__main__":
    main()
