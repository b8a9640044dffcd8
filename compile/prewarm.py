"""Warm a model's compiled buckets in one process, through the shared compile cache.

`python -m compile.prewarm --model DIR --buckets 32x32,48x32 --store DIR` (with the fleet's
compile cache key in DITFLEET_COMPILE_CACHE_KEY, or another variable named by --key-env) loads the pipeline,
loads the shared cache (if any), compiles and warms every bucket, saves the cache (if it was
missing), and prints one JSON line of timings. It is what one actor's start-up does, on its own:
run it on one node to fill the cache before a fleet starts, or in fresh processes to measure
what the shared cache saves (ditfleet.testing.prewarm.spawn_prewarm, for the tests and the benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from .buckets import BucketSet
from .cache import DirectoryArtifactStore
from .config import COMPILE_CACHE_KEY_ENV, CompileConfig, OnOffAuto
from .prepare import prepare_worker_pipeline
from .warmup import WarmupRuns

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prewarm(
    model: str,
    buckets: Sequence[str],
    store_dir: str | None,
    device: str = "cpu",
    dtype: str = "float32",
    dit: OnOffAuto = CompileConfig.dit,  # "auto": off on the CPU (CompileConfig.dit_on)
    steps: int = 2,
    cache_secret: bytes | None = None,
    claim_timeout_s: float = CompileConfig.claim_timeout_s,
) -> dict[str, Any]:
    """One actor's start-up (`prepare_worker_pipeline`) with a directory as the shared store;
    without `cache_secret` nothing is shared."""
    from ditfleet.model import load_pipeline

    start = time.perf_counter()
    pipe = load_pipeline(model, device=device, dtype=_DTYPES[dtype])
    store = DirectoryArtifactStore(store_dir) if store_dir else None
    prepared = prepare_worker_pipeline(
        pipe,
        CompileConfig(vae=True, dit=dit, claim_timeout_s=claim_timeout_s),  # prewarming is compiling
        BucketSet.from_names(buckets).buckets,
        store,
        cache_secret,
        runs=WarmupRuns(steps=steps),
    )
    warm, loaded, saved = prepared.warmup, prepared.cache_load, prepared.cache_save
    assert warm is not None  # the VAE is compiled, so there was a warm-up
    cache = loaded or saved
    return {
        "key": cache.key if cache else "",
        "load": loaded.status if loaded else "off",
        "load_s": round(loaded.seconds, 3) if loaded else 0.0,
        "kernels_loaded": loaded.kernels if loaded else 0,
        "warmup_s": round(warm.seconds, 3),
        "seconds_per_bucket": {k: round(v, 3) for k, v in warm.seconds_per_bucket().items()},
        "compiles": warm.compiles,
        "inductor_compiles": sum(b.inductor_compiles for b in warm.buckets),
        "buckets": [
            {
                "bucket": b.bucket,
                "claim": b.claim,
                "waited_s": b.waited_s,
                "inductor_compiles": b.inductor_compiles,
            }
            for b in warm.buckets
        ],
        "fallbacks": prepared.fallbacks,
        "save": saved.status if saved else "skipped",
        "save_bytes": saved.bytes if saved else 0,
        "total_s": round(time.perf_counter() - start, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compile.prewarm", description=__doc__)
    parser.add_argument("--model", required=True, help="diffusers-layout model folder, or 'tiny'")
    parser.add_argument("--buckets", required=True, help="comma-separated WxH, e.g. 1328x1328,1664x928")
    parser.add_argument("--store", default=None, help="directory of the shared compile cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--dit", action="store_true", help="also compile the DiT blocks")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--claim-timeout",
        type=float,
        default=CompileConfig.claim_timeout_s,
        help="seconds to wait for another process compiling a bucket on this machine (0: no claims)",
    )
    parser.add_argument(
        "--key-env",
        default=COMPILE_CACHE_KEY_ENV,
        help="environment variable holding the compile cache key (without it nothing is shared)",
    )
    args = parser.parse_args(argv)
    # The key is a credential: it comes from the environment of this entry point, never a file
    # in the store. Its text (at least 16 bytes) is the HMAC key.
    key_text = os.environ.get(args.key_env, "")
    secret = key_text.encode() if key_text else None
    result = prewarm(
        args.model,
        [b for b in args.buckets.split(",") if b],
        args.store,
        device=args.device,
        dtype=args.dtype,
        dit=args.dit,
        steps=args.steps,
        cache_secret=secret,
        claim_timeout_s=args.claim_timeout,
    )
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
