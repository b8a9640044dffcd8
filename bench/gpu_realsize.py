"""Qwen-Image at its real size on one GPU, with random weights: load, memory, DiT, CFG, VAE.

    python bench/gpu_realsize.py                          # full depth (60 blocks), bf16, cuda
    python bench/gpu_realsize.py --layers 1 --size 256    # the CPU smoke test (seconds)

Writes the published layout (ditfleet/testing/published/qwen-image configs, random bf16 weights in
5 GB shards plus the .index.json, the VAE in diffusers' 3D layout; no text encoder: prompts are
random embeddings) into --workdir, or uses --checkpoint, then loads it with `load_pipeline` and
measures, per image size:

- ms per DiT forward (batch 1, a --text-len token prompt), ms per CFG step (a conditional and an
  unconditional forward sharing the step's modulation, then the CFG combine and the Euler step),
- ms per VAE decode, eager and compiled (compiled only on CUDA unless --compile-vae on),
- images per hour at --steps steps (CFG steps plus the fastest decode),

and the load seconds, the peak device memory (CUDA: torch.cuda.max_memory_allocated) next to
what `model.memory` plans for the same work. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ditfleet.compile import CompileConfig, apply_compile  # noqa: E402
from ditfleet.model import load_pipeline  # noqa: E402
from ditfleet.model.memory import GB, ModelMemory, plan_memory  # noqa: E402
from ditfleet.model.sampling import LATENT_CHANNELS, euler_step, true_cfg  # noqa: E402
from ditfleet.model.scheduler import sigma_schedule  # noqa: E402
from ditfleet.model.vae import QwenImageVAE, VAEConfig, save_vae  # noqa: E402
from ditfleet.testing.real_widths import PUBLISHED, published_config, write_random_transformer  # noqa: E402

MODEL = "qwen-image"


def write_checkpoint(root: Path, layers: int, shard_bytes: int) -> Path:
    """The published layout at `layers` blocks with random weights (bf16), no text encoder."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PUBLISHED / MODEL / "model_index.json", root / "model_index.json")
    (root / "scheduler").mkdir(exist_ok=True)
    shutil.copy(PUBLISHED / MODEL / "scheduler" / "scheduler_config.json", root / "scheduler")
    config = {**published_config(MODEL, "transformer/config.json"), "num_layers": layers}
    write_random_transformer(root / "transformer", config, shard_bytes)
    vae_config = VAEConfig.from_dict(published_config(MODEL, "vae/config.json"))
    torch.manual_seed(0)
    vae = QwenImageVAE(vae_config, with_encoder=True).to(torch.bfloat16)
    save_vae(vae, root / "vae")
    return root


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, repeat: int) -> float:
    """Median wall ms of `repeat` calls after one warm call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def measure_size(pipe, size: int, text_len: int, steps: int, repeat: int, compile_vae: bool) -> dict:
    device, dtype = pipe.device, pipe.dtype
    h = w = size // 16
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, h * w, 4 * LATENT_CHANNELS, generator=g).to(device, dtype)
    cond = torch.randn(1, text_len, 3584, generator=g).to(device, dtype)
    uncond = torch.randn(1, 4, 3584, generator=g).to(device, dtype)  # a short negative prompt
    sigmas = sigma_schedule(pipe.scheduler, steps, h * w).to(device)
    timestep = sigmas[:1].to(dtype)  # t / 1000 of the first step
    shapes = [[(1, h, w)]]
    dit = pipe.transformer

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return dit(latents, cond, None, timestep, shapes)

    def cfg_step() -> torch.Tensor:
        with torch.no_grad():
            c = dit(latents, cond, None, timestep, shapes)
            u = dit(latents, uncond, None, timestep, shapes)  # same timestep tensor: modulation reused
            return euler_step(latents, true_cfg(c, u, 4.0), sigmas[0], sigmas[1])

    z = torch.randn(1, 16, size // 8, size // 8, generator=g).to(device, pipe.vae_dtype)

    def decode() -> torch.Tensor:
        with torch.no_grad():
            return pipe.vae.decode(z)

    out = {
        "dit_forward_ms": round(timed_ms(forward, device, repeat), 2),
        "cfg_step_ms": round(timed_ms(cfg_step, device, repeat), 2),
        "vae_decode_eager_ms": round(timed_ms(decode, device, repeat), 2),
        "vae_decode_compiled_ms": None,
        "vae_compile_s": None,
    }
    if compile_vae:
        apply_compile(pipe, CompileConfig(vae=True, dit=False, shared_cache=False))
        t0 = time.perf_counter()
        decode()
        _sync(device)
        out["vae_compile_s"] = round(time.perf_counter() - t0, 2)
        out["vae_decode_compiled_ms"] = round(timed_ms(decode, device, repeat), 2)
    best_decode = min(v for v in (out["vae_decode_eager_ms"], out["vae_decode_compiled_ms"]) if v is not None)
    per_image_ms = steps * out["cfg_step_ms"] + best_decode
    out["images_per_hour"] = round(3_600_000 / per_image_ms, 1)
    model = ModelMemory.from_dir(Path(pipe.model_id))
    plan = plan_memory(
        model, height=size, width=size, batch=1, dtype="bf16" if dtype == torch.bfloat16 else "fp32",
        text_encoder="cpu", text_len=text_len, vae_batch=1,
    )  # fmt: skip
    out["plan_peak_gb"] = round(plan.peak / GB, 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=60, help="DiT blocks (published: 60)")
    p.add_argument("--size", type=int, nargs="+", default=[1024, 1328], help="square image sizes")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, default=50, help="steps per image for images/hour")
    p.add_argument("--text-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compile-vae", choices=("auto", "on", "off"), default="auto", help="auto: on for cuda")
    p.add_argument(
        "--checkpoint", help="an existing diffusers-layout folder (else random weights are written)"
    )
    p.add_argument("--workdir", help="where to write the random checkpoint (default: a temp dir, removed)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size of the written checkpoint")
    args = p.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if device.type == "auto":
        device = torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    compile_vae = args.compile_vae == "on" or (args.compile_vae == "auto" and device.type == "cuda")
    tmp = None
    try:
        if args.checkpoint:
            root = Path(args.checkpoint)
            write_s = 0.0
        else:
            tmp = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_realsize-"))
            t0 = time.perf_counter()
            root = write_checkpoint(tmp / "qwen-image", args.layers, int(args.shard_gb * GB))
            write_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        pipe = load_pipeline(
            root, device=device, dtype=dtype, load_text_encoder_too=False, model_id=str(root)
        )
        _sync(device)
        load_s = time.perf_counter() - t0
        weights_gb = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters()) / GB
        sizes = {
            f"{s}x{s}": measure_size(pipe, s, args.text_len, args.steps, args.repeat, compile_vae)
            for s in args.size
        }
        result = {
            "bench": "gpu_realsize",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dtype": args.dtype,
            "layers": pipe.transformer.config.num_layers,
            "dit_weights_gb": round(weights_gb, 2),
            "write_s": round(write_s, 1),
            "load_s": round(load_s, 2),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / GB, 2)
            if device.type == "cuda"
            else None,
            "steps": args.steps,
            "text_len": args.text_len,
            "sizes": sizes,
        }
    finally:
        if tmp is not None and not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
