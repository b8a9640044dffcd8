"""Host memory while loading a sharded transformer: streaming (shard by shard, tensor by tensor)
vs reading the whole state dict first, each in a fresh process, side by side.

    python bench/load_rss.py                          # builds a 1-block real-widths checkpoint
    python bench/load_rss.py --model /models/Qwen-Image --device cuda --dtype bf16

Without --model it writes Qwen-Image's published layout cut to `--layers` blocks (hidden 3072,
text 3584), random bf16 weights in hub-style shards of `--shard-mb` plus the index, to a
temporary folder. Each method runs in its own child process: the baseline is that process's
RSS after imports and after the model is built on the meta device; the peak is the kernel's
high-water mark (ru_maxrss) and a 1 ms sampler, whichever is higher.

On a GPU the loaded weights live in device memory, so host RSS above the baseline is all
transient: `ratio` = (peak - baseline) / largest shard. On the CPU the weights themselves end up
in host memory; `ratio` then counts only what is held beyond them (peak - baseline - the loaded
model's bytes). Prints a report and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(model_dir: Path, method: str, dtype_name: str, device: str, quantization: str = "none") -> dict:
    """Runs in the child process: load the transformer once and report memory."""
    import gc

    import torch

    from ditfleet.model.loading.checkpoint import Checkpoint, load_streaming
    from ditfleet.model.loading.weights import assign_state_dict, read_state_dict
    from ditfleet.model.qwen_image.loader import prepare_transformer

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    tdir = model_dir / "transformer"
    model, checkpoint = prepare_transformer(tdir)
    gc.collect()
    baseline, maxrss_before = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if method == "streaming" and quantization != "none":
        # quantized as it streams in (model.qwen_image.fp8): the bf16 DiT never exists as a whole
        from ditfleet.model.qwen_image.fp8 import Fp8Quantizer

        load_streaming(model, checkpoint, str(tdir), dtype, device, transform=Fp8Quantizer(quantization))
    elif method == "streaming":
        load_streaming(model, checkpoint, str(tdir), dtype, device)
    else:  # the previous loader: every shard read into one dict, then cast and assigned
        assign_state_dict(model, read_state_dict(tdir), str(tdir), dtype, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    # Touch every page of every weight, as the first forward would: a memory-mapped tensor
    # costs nothing until it is read, so without this a lazy loader would look free.
    with torch.no_grad():
        for t in model.state_dict().values():
            flat = t.reshape(-1)
            flat[:: max(1, 2048 // t.element_size())].float().sum().item()
    done.set()
    sampler.join()
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    top = max(peak[0], maxrss_after if maxrss_after > maxrss_before else 0)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    resident = model_bytes if device == "cpu" else 0
    largest = Checkpoint(tdir).largest_file_bytes
    return {
        "method": method,
        "quantization": quantization,
        "load_s": round(load_s, 2),
        "baseline_mb": round(baseline / MB, 1),
        "peak_above_baseline_mb": round((top - baseline) / MB, 1),
        "model_mb": round(model_bytes / MB, 1),
        "held_beyond_model_mb": round((top - baseline - resident) / MB, 1),
        "ratio": round((top - baseline - resident) / largest, 3),
    }


def _child(model_dir: Path, method: str, dtype: str, device: str, quantization: str = "none") -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            method,
            "--model",
            str(model_dir),
            "--dtype",
            dtype,
            "--device",
            device,
            "--quantization",
            quantization,
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="a diffusers-layout folder (default: build a real-widths one)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default="streaming,whole")
    ap.add_argument(
        "--quantization",
        default="none",
        help="none | fp8 | fp8-weight-only (streaming only: quantized as it loads)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.dtype, args.device, args.quantization)))
        return

    with tempfile.TemporaryDirectory(prefix="load-rss-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from ditfleet.testing.real_widths import write_real_widths_checkpoint

            model_dir = write_real_widths_checkpoint(
                Path(tmp) / "qwen-image", num_layers=args.layers, shard_bytes=args.shard_mb * MB
            )
        from ditfleet.model.loading.checkpoint import Checkpoint

        ckpt = Checkpoint(model_dir / "transformer")
        largest, total = ckpt.largest_file_bytes, sum(f.stat().st_size for f in ckpt.files)
        runs = {
            m: _child(model_dir, m, args.dtype, args.device, args.quantization)
            for m in args.methods.split(",")
        }
    print(
        f"transformer: {len(ckpt.files)} shards, largest {largest / MB:.0f} MB, total {total / MB:.0f} MB; "
        f"load as {args.dtype} on {args.device}"
    )
    for m, r in runs.items():
        print(
            f"  {m:9s} peak above baseline {r['peak_above_baseline_mb']:8.1f} MB, held beyond the model "
            f"{r['held_beyond_model_mb']:8.1f} MB = {r['ratio']:.2f} x largest shard, {r['load_s']:.1f} s"
        )
    print(
        json.dumps(
            {
                "bench": "load_rss",
                "dtype": args.dtype,
                "device": args.device,
                "quantization": args.quantization,
                "shards": len(ckpt.files),
                "largest_shard_mb": round(largest / MB, 1),
                "total_mb": round(total / MB, 1),
                **{f"{m}_{k}": v for m, r in runs.items() for k, v in r.items() if k != "method"},
            }
        )
    )


if __name__ == "__main__":
    main()
