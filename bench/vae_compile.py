"""VAE decode compiled vs eager, first request vs steady state, warm-up with vs without the
shared compile cache: side by side in one run.

1. Decode per bucket: eager and compiled calls interleaved round after round (so machine noise
   hits both alike); median ms of each and the ratio.
2. Requests after warm-up (encode -> denoise with CFG -> decode, prompts padded to their bucket):
   the first one per bucket against the median of the following ones. Target: <= 1.2.
3. Warm-up in two fresh processes, each with its own empty local Inductor cache, sharing one
   store: the first compiles and saves, the second loads. The ratio is what the fleet saves.

    python bench/vae_compile.py                              # CPU, random tiny model, 2 buckets
    python bench/vae_compile.py --device cuda --model /models/Qwen-Image --dtype bfloat16 \\
        --buckets 1328x1328,1664x928

Prints a table, then one JSON line. Absolute times only count on a GPU; on a CPU the decode and
request times are CPU time of this process (run with OMP_NUM_THREADS=1), warm-ups wall time.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.compile import (  # noqa: E402
    BucketSet,
    CompileConfig,
    apply_compile,
    compile_count,
    remove_compile,
    warm_up,
)
from ditfleet.model import load_pipeline  # noqa: E402
from ditfleet.testing.prewarm import spawn_prewarm  # noqa: E402
from ditfleet.testing.prompt_padding import encode_padded  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT = "a lighthouse on a rocky coast at dawn"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(device: torch.device, fn, *args, **kwargs) -> float:
    """Milliseconds of fn(*args, **kwargs).

    On a GPU: wall time, the device synchronised on both sides. On a CPU: this process's CPU
    time, which other tenants of a shared machine do not inflate (wall time there is mostly noise).
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    _sync(device)
    start = clock()
    fn(*args, **kwargs)
    _sync(device)
    return (clock() - start) * 1e3


def random_model(root: Path) -> Path:
    """A tiny random-weight model in the diffusers layout (needs the test extra: diffusers)."""
    from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir

    return add_tiny_text_encoder(make_diffusers_model_dir(root))


@torch.no_grad()
def decode_side_by_side(pipe, buckets, rounds: int) -> list[dict]:
    """Eager vs compiled decode, interleaved; the pipeline must already be compiled and warm."""
    vae, device = pipe.vae, pipe.device
    eager_decode = type(vae).decode
    rows = []
    for bucket in buckets:
        g = torch.Generator().manual_seed(0)
        z = torch.randn(1, 16, bucket.height // 8, bucket.width // 8, generator=g)
        z = z.to(device, pipe.vae_dtype)
        eager_decode(vae, z), vae.decode(z)  # noqa: B018 - first calls off the clock
        eager, compiled = [], []
        for _ in range(rounds):
            eager.append(_ms(device, eager_decode, vae, z))
            compiled.append(_ms(device, vae.decode, z))
        e, c = statistics.median(eager), statistics.median(compiled)
        rows.append({"bucket": bucket.name, "eager_ms": e, "compiled_ms": c, "speedup": e / c})
    return rows


def _request(pipe, height: int, width: int, steps: int, seed: int) -> None:
    """One request as the worker makes it: encode, pad to the prompt-length bucket, generate."""
    inputs = encode_padded(pipe, [PROMPT])
    pipe.generate(**inputs, height=height, width=width, steps=steps, true_cfg_scale=4.0, seeds=[seed])


@torch.no_grad()
def first_vs_steady(pipe, buckets, steps: int, requests: int) -> list[dict]:
    """The first request per bucket after warm-up, against the median of the next ones."""
    rows = []
    for bucket in buckets:
        times = [
            _ms(pipe.device, _request, pipe, bucket.height, bucket.width, steps, seed)
            for seed in range(requests)
        ]
        steady = statistics.median(times[1:])
        rows.append(
            {"bucket": bucket.name, "first_ms": times[0], "steady_ms": steady, "ratio": times[0] / steady}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--model", default=None, help="diffusers-layout folder; default: a random tiny model")
    ap.add_argument("--buckets", default="128x128,160x96")
    ap.add_argument("--rounds", type=int, default=10, help="decode timings per bucket and side")
    ap.add_argument("--requests", type=int, default=5, help="requests per bucket after warm-up")
    ap.add_argument("--steps", type=int, default=20, help="denoising steps per request")
    ap.add_argument("--skip-shared-cache", action="store_true", help="skip the two-process part")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vae-compile-bench-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> None:
    """The three measurements; `work` holds the random model, the local caches and the store."""
    model = args.model or str(random_model(work / "model"))
    buckets = BucketSet.from_names(args.buckets.split(",")).buckets
    pipe = load_pipeline(model, device=args.device, dtype=DTYPES[args.dtype])
    device = pipe.device

    # 1 + 2: one process; compile from whatever local Inductor cache this machine has.
    report = apply_compile(pipe, CompileConfig(vae=True))
    warm = warm_up(pipe, buckets)
    after_warmup = compile_count()
    steady = first_vs_steady(pipe, buckets, args.steps, args.requests)
    decode = decode_side_by_side(pipe, buckets, args.rounds)
    request_compiles = compile_count() - after_warmup
    remove_compile(pipe)

    # 3: two fresh processes, empty local caches, one shared store.
    shared = None
    if not args.skip_shared_cache:
        names = [b.name for b in buckets]
        store = work / "shared-store"
        env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if device.type == "cpu" else {}
        env["DITFLEET_COMPILE_CACHE_KEY"] = secrets.token_hex(32)  # blobs are sealed with it
        cold = spawn_prewarm(model, names, store, work / "inductor-a", args.device, extra_env=env)
        hot = spawn_prewarm(model, names, store, work / "inductor-b", args.device, extra_env=env)
        cold_s, hot_s = cold["load_s"] + cold["warmup_s"], hot["load_s"] + hot["warmup_s"]
        shared = {
            "without_s": cold_s,
            "with_s": hot_s,
            "speedup": cold_s / hot_s,
            "load": hot["load"],
            "blob_bytes": cold["save_bytes"],
        }

    print(f"device {device}, dtype {args.dtype}, torch {torch.__version__}, model {model}")
    print(f"warm-up (this process): {warm.seconds:.1f} s, {warm.compiles} compiles; per bucket "
          + ", ".join(f"{b}: {s:.1f} s" for b, s in warm.seconds_per_bucket().items()))  # fmt: skip
    print(f"{'bucket':>10} {'eager ms':>10} {'compiled ms':>12} {'speedup':>8}")
    for r in decode:
        print(f"{r['bucket']:>10} {r['eager_ms']:>10.2f} {r['compiled_ms']:>12.2f} {r['speedup']:>7.2f}x")
    print(f"{'bucket':>10} {'first ms':>10} {'steady ms':>12} {'ratio':>8}   (requests, {args.steps} steps)")
    for r in steady:
        print(f"{r['bucket']:>10} {r['first_ms']:>10.1f} {r['steady_ms']:>12.1f} {r['ratio']:>8.2f}")
    print(f"compilations on the request path: {request_compiles}; fallbacks: {report.fallbacks or 'none'}")
    if shared:
        print(
            f"warm-up in a fresh process: without shared cache {shared['without_s']:.1f} s, with it "
            f"{shared['with_s']:.1f} s ({shared['speedup']:.1f}x; blob {shared['blob_bytes'] / 1e6:.1f} MB)"
        )
    print(
        json.dumps(
            {
                "bench": "vae_compile",
                "device": str(device),
                "dtype": args.dtype,
                "torch": torch.__version__,
                "buckets": [b.name for b in buckets],
                "decode": [
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in decode
                ],
                "first_vs_steady": [
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in steady
                ],
                "warmup_s": round(warm.seconds, 3),
                "request_compiles": request_compiles,
                "fallbacks": report.fallbacks,
                "shared_cache": {k: round(v, 3) if isinstance(v, float) else v for k, v in shared.items()}
                if shared
                else None,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
