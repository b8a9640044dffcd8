"""What FP8 DiT weights cost in accuracy and memory, side by side with bf16 (one JSON line per result).

    python bench/fp8.py --part gemm                  # one 3072x3072 GEMM with outlier channels
    python bench/fp8.py --part forward --layers 2    # one DiT forward at published widths vs fp32
    python bench/fp8.py --part ablation              # which layers to keep in bf16 (per-forward error)
    python bench/fp8.py --part tiny --steps 20 --steps 50   # the bundled model: adherence, PSNR/SSIM
    python bench/fp8.py --part rss                   # host RSS while loading an FP8 DiT
    python bench/fp8.py --part gpu --layers 60       # on a GPU: ms per forward at 1328x1328, peak memory

Variants: "bf16" (weights and activations bf16), "fp8" (FP8 e4m3 weights with per-output-channel
scales, activations quantized per token, torch._scaled_mm), "fp8-weight-only" (the same weights,
dequantized to bf16 for each GEMM). Both FP8 variants keep model.loading.quantization.KEEP_IN_LOAD_DTYPE in
bf16 and compute with bf16 activations, as on a GPU. The reference is the same model in fp32.

Published-width weights are random with the outliers trained ones have
(ditfleet/testing/outliers.py): a few residual channels 25x larger, heavy-tailed weight columns.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ditfleet.model.loading.quantization import KEEP_IN_LOAD_DTYPE  # noqa: E402
from ditfleet.model.qwen_image.fp8 import quantize_model, quantize_rows, quantize_weight  # noqa: E402
from ditfleet.testing.outliers import (  # noqa: E402
    cast_inputs,
    forward_inputs,
    outlier_transformer,
    relative_error,
)

VARIANTS = ("bf16", "fp8", "fp8-weight-only")


def emit(**row) -> None:
    print(json.dumps({"bench": "fp8", **row}), flush=True)


# -- one GEMM --------------------------------------------------------------------------------------


def part_gemm(tokens: int = 256, dim: int = 3072, seed: int = 0) -> None:
    """The issue's scale: one D x D GEMM, activations with 4 outlier channels, heavy-tailed weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    x[:, [7, 301, 1500, 2900]] *= 25.0
    w = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
    w[:, torch.randperm(dim, generator=g)[: dim // 100]] *= 6.0
    ref = x @ w.t()
    xb = x.bfloat16()
    w8, s = quantize_weight(w)
    x8, sx = quantize_rows(xb)
    got = {
        "bf16": xb @ w.bfloat16().t(),
        "fp8": torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=s[None], out_dtype=torch.bfloat16),
        "fp8-weight-only": xb @ (w8.to(torch.bfloat16) * s.to(torch.bfloat16)[:, None]).t(),
    }
    emit(
        part="gemm",
        shape=[tokens, dim, dim],
        **{f"rel_err_{k}": round(relative_error(v, ref), 5) for k, v in got.items()},
    )


# -- one DiT forward -------------------------------------------------------------------------------


def _variant(dit32, variant: str, keep=KEEP_IN_LOAD_DTYPE):
    model = copy.deepcopy(dit32)
    if variant == "bf16":
        return model.to(torch.bfloat16)
    # Quantized from the fp32 weights; the kept layers (and norms, biases) in bf16.
    quantize_model(model, variant, keep)
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dtype == torch.float32:
                setattr(m, name, torch.nn.Parameter(p.to(torch.bfloat16), requires_grad=False))
    return model


def _forward(model, inputs: dict, dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode():
        return model(**cast_inputs(inputs, dtype)).float()


def part_forward(layers: int, grid: tuple[int, int], text_len: int, seed: int) -> None:
    dit = outlier_transformer(layers, seed)
    inputs = forward_inputs(dit, grid, text_len, seed=seed)
    ref = _forward(dit, inputs, torch.float32)
    for variant in VARIANTS:
        t0 = time.perf_counter()
        model = _variant(dit, variant)
        out = _forward(model, inputs, torch.bfloat16)
        emit(
            part="forward",
            layers=layers,
            image_tokens=grid[0] * grid[1],
            text_tokens=text_len,
            variant=variant,
            rel_err=round(relative_error(out, ref), 5),
            weight_mb=round(
                sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20, 1
            ),
            s=round(time.perf_counter() - t0, 1),
        )
        del model


# Layer groups, as full-match patterns on module names, for the ablation.
GROUPS = {
    "modulation": (r"transformer_blocks\.\d+\.(img|txt)_mod\.1",),
    "qkv": (r"transformer_blocks\.\d+\.attn\.(to_[qkv]|add_[qkv]_proj)",),
    "attn_out": (r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)",),
    "mlp_up": (r"transformer_blocks\.\d+\.(img|txt)_mlp\.net\.0\.proj",),
    "img_mlp.net.2": (r"transformer_blocks\.\d+\.img_mlp\.net\.2",),
    "txt_mlp.net.2": (r"transformer_blocks\.\d+\.txt_mlp\.net\.2",),
}


def part_ablation(layers: int, grid: tuple[int, int], text_len: int, seed: int, variants: list[str]) -> None:
    """Per-forward error with the default kept layers, with nothing kept, and with each group kept
    in bf16 on top of the default (the error that group's quantization accounts for)."""
    dit = outlier_transformer(layers, seed)
    inputs = forward_inputs(dit, grid, text_len, seed=seed)
    ref = _forward(dit, inputs, torch.float32)
    options = {"default": KEEP_IN_LOAD_DTYPE, "nothing kept": ()}
    options.update({f"default + {g}": KEEP_IN_LOAD_DTYPE + pats for g, pats in GROUPS.items()})
    for variant in variants:
        for label, keep in options.items():
            model = _variant(dit, variant, keep)
            bf16_params = sum(
                p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
            )
            emit(
                part="ablation",
                layers=layers,
                variant=variant,
                keep=label,
                rel_err=round(relative_error(_forward(model, inputs, torch.bfloat16), ref), 5),
                bf16_linear_params_m=round(bf16_params / 1e6, 1),
            )
            del model


# -- the bundled tiny model ------------------------------------------------------------------------


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over images of 10 log10(1 / MSE), images in [0, 1]."""
    mse = (a.double() - b.double()).pow(2).flatten(1).mean(1).clamp_min(1e-12)
    return float((10 * torch.log10(1 / mse)).mean())


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM (Gaussian window 11, sigma 1.5, per channel), images (B, 3, H, W) in [0, 1]."""
    a, b = a.double(), b.double()
    x = torch.arange(11, dtype=torch.float64) - 5
    k1 = torch.exp(-(x**2) / (2 * 1.5**2))
    k1 = k1 / k1.sum()
    win = (k1[:, None] * k1[None, :]).expand(a.shape[1], 1, 11, 11)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, win, groups=a.shape[1])

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


def part_tiny(steps_list: list[int], cfg: float, variants: list[str]) -> None:
    """The tiny model (fp32 on the CPU) as shipped and quantized: adherence on the 64 held-out
    captions, and PSNR/SSIM of each quantized image against the unquantized one (same seed)."""
    from ditfleet.model import load_pipeline
    from ditfleet.model.tiny.adherence import generate_held_out, score

    pipes = {q: load_pipeline("tiny", quantization=q) for q in ("none", *variants)}
    for steps in steps_list:
        exact, captions = generate_held_out(pipes["none"], steps, cfg)
        base = score(exact, captions)
        emit(part="tiny", steps=steps, cfg=cfg, variant="none", **{k: round(v, 4) for k, v in base.items()})
        for q in variants:
            images, _ = generate_held_out(pipes[q], steps, cfg)
            s = score(images, captions)
            emit(
                part="tiny",
                steps=steps,
                cfg=cfg,
                variant=q,
                **{k: round(v, 4) for k, v in s.items()},
                worst_drop_points=round(100 * max(base[k] - s[k] for k in base if k != "iou"), 2),
                psnr_db=round(psnr(images, exact), 2),
                ssim=round(ssim(images, exact), 4),
            )


# -- host memory while loading ---------------------------------------------------------------------


def part_rss(layers: int, shard_mb: int, variants: list[str]) -> None:
    """bench/load_rss.py's measurement (a fresh process per load) with the DiT quantized while it streams."""
    import subprocess
    import tempfile

    from ditfleet.testing.real_widths import write_real_widths_checkpoint

    with tempfile.TemporaryDirectory(prefix="fp8-rss-") as tmp:
        root = write_real_widths_checkpoint(
            Path(tmp) / "qwen-image", num_layers=layers, shard_bytes=shard_mb * 2**20
        )
        for q in variants:
            out = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "bench" / "load_rss.py"),
                    "--model",
                    str(root),
                    "--methods",
                    "streaming",
                    "--quantization",
                    q,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            emit(part="rss", quantization=q, layers=layers, **{k: v for k, v in r.items() if k != "bench"})


# -- on a GPU ----------------------------------------------------------------------------------------


def forward_cost(forward, device: torch.device | str, iters: int = 5, warm: int = 1) -> dict:
    """ms per call of `forward()` (mean of `iters` after `warm`) and, on CUDA, the device's peak
    memory during the calls and above what was allocated before them, in GB (JSON-able)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    with torch.inference_mode():
        for _ in range(warm):
            forward()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        for _ in range(iters):
            forward()
        sync()
        ms = 1000 * (time.perf_counter() - t0) / max(iters, 1)
    row: dict = {"ms_per_forward": round(ms, 2), "peak_gb": None, "peak_above_weights_gb": None}
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        row["peak_gb"] = round(peak / 1e9, 2)
        row["peak_above_weights_gb"] = round((peak - before) / 1e9, 2)
    return row


def gpu_forward(
    layers: int = 60, size: int = 1328, text_len: int = 512, iters: int = 5, device: str = "cuda"
) -> list[dict]:
    """ms per DiT forward at size x size (batch 1) and peak device memory, bf16 vs FP8, random
    weights built on the device (no checkpoint). Prints and returns one JSON row per variant.

    The node self-test measures the same on its loaded DiT (workers/selftest/parts.fp8_copy). fp8
    runs only where the device has FP8 matrix units (model.qwen_image.fp8.check_device), fp8-weight-only
    everywhere."""
    from ditfleet.model.loading.quantization import QuantizationError
    from ditfleet.model.qwen_image.fp8 import check_device
    from ditfleet.model.qwen_image.published import published_config
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

    config = TransformerConfig.from_dict(
        {**published_config("qwen-image", "transformer/config.json"), "num_layers": layers}
    )
    grid = size // 16
    g = torch.Generator(device).manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(
            1, grid * grid, config.in_channels, generator=g, device=device, dtype=torch.bfloat16
        ),
        "encoder_hidden_states": torch.randn(
            1, text_len, config.joint_attention_dim, generator=g, device=device, dtype=torch.bfloat16
        ),
        "encoder_hidden_states_mask": None,
        "timestep": torch.full((1,), 0.6, device=device, dtype=torch.bfloat16),
        "img_shapes": [[(1, grid, grid)]],
    }
    rows = []
    for variant in ("bf16", "fp8", "fp8-weight-only"):
        row = {"part": "gpu", "variant": variant, "layers": layers, "size": size, "text_len": text_len}
        try:
            if variant != "bf16":
                check_device(variant, device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with torch.device(device):
                dit = QwenImageTransformer(config).to(torch.bfloat16).eval().requires_grad_(False)
            if variant != "bf16":
                quantize_model(dit, variant)  # layer by layer: the bf16 copy of one layer at a time
            torch.cuda.synchronize()
            row["weights_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
            # The forward's peak (reset after the warm-up call), not the bf16 build's.
            row.update(forward_cost(lambda dit=dit: dit(**inputs), device, iters=iters))
            row["device"] = torch.cuda.get_device_name()
            del dit
        except (QuantizationError, RuntimeError) as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        emit(**row)
    base = next((r for r in rows if r["variant"] == "bf16" and "ms_per_forward" in r), None)
    for r in rows:
        if base and "ms_per_forward" in r and r is not base:
            emit(
                part="gpu_ratio",
                variant=r["variant"],
                speedup_vs_bf16=round(base["ms_per_forward"] / r["ms_per_forward"], 3),
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", action="append", choices=["gemm", "forward", "ablation", "tiny", "rss", "gpu"])
    ap.add_argument("--layers", type=int, default=None, help="DiT blocks (forward/ablation 1, rss 2, gpu 60)")
    ap.add_argument("--grid", type=int, nargs=2, default=(8, 8), help="latent token grid of the forward")
    ap.add_argument("--text-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, action="append", help="tiny-model steps (default 20 and 50)")
    ap.add_argument("--cfg", type=float, default=2.0, help="the tiny model's README setting")
    ap.add_argument("--variants", default="fp8,fp8-weight-only")
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--size", type=int, default=1328)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    for part in args.part or ["gemm", "forward"]:
        if part == "gemm":
            part_gemm()
        elif part == "forward":
            part_forward(args.layers or 1, tuple(args.grid), args.text_len, args.seed)
        elif part == "ablation":
            part_ablation(args.layers or 1, tuple(args.grid), args.text_len, args.seed, variants)
        elif part == "tiny":
            part_tiny(args.steps or [20, 50], args.cfg, variants)
        elif part == "rss":
            part_rss(args.layers or 2, args.shard_mb, ["none", *variants])
        elif part == "gpu":
            gpu_forward(args.layers or 60, args.size, args.text_len if args.text_len != 32 else 512)


if __name__ == "__main__":
    main()
