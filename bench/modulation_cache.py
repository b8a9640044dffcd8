"""DiT time per CFG step with the modulation cache off / cfg / table, side by side in one run.

The model has Qwen-Image's proportions (MLP 4x, modulation 6x dim per stream, text dim ~1.17x
model dim, head dim 128 split (16, 56, 56)) scaled down to run on a CPU. The three modes run
interleaved, round after round, so machine noise hits them alike; the ratios are what count.

    python bench/modulation_cache.py                     # CPU, scaled-down config
    python bench/modulation_cache.py --device cuda --dtype bf16 --layers 60 --heads 24 --size 1328
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ditfleet.model.generation.sampling import Conditioning, TimestepBank, latent_grid, true_cfg
from ditfleet.model.qwen_image.family import forward_flops
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="CFG steps per round")
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = TransformerConfig(
        num_layers=args.layers,
        num_attention_heads=args.heads,
        attention_head_dim=128,
        joint_attention_dim=int(args.heads * 128 * 3584 / 3072),
        axes_dims_rope=(16, 56, 56),
    )
    torch.manual_seed(0)
    model = QwenImageTransformer(cfg).to(args.device, dtype).eval().requires_grad_(False)
    h, w = latent_grid(args.size, args.size)
    x = torch.randn(1, h * w, 64, device=args.device, dtype=dtype)
    cond = Conditioning(
        torch.randn(1, args.text_tokens, cfg.joint_attention_dim, device=args.device, dtype=dtype), None
    )
    uncond = Conditioning(torch.randn(1, 8, cfg.joint_attention_dim, device=args.device, dtype=dtype), None)
    shapes = [[(1, h, w)]]
    sigmas = torch.linspace(1.0, 0.1, args.steps + 1, device=args.device)
    bank = TimestepBank()

    def cfg_steps(mode: str) -> float:
        model.modulation_cache.set_mode(mode) if model.modulation_cache.mode != mode else None
        steps = bank.get(sigmas, ("bench", args.steps), args.device, dtype) if mode == "table" else None
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(args.steps):
                t = steps[i] if steps is not None else (sigmas[i : i + 1] * 1000 / 1000).to(dtype)
                c = model(x, cond.embeds, None, t, shapes)
                u = model(x, uncond.embeds, None, t, shapes)
                true_cfg(c, u, 4.0)
        sync()
        return (time.perf_counter() - t0) / args.steps

    modes = ("off", "cfg", "table")
    for m in modes:  # warm-up (and the table's first fill)
        cfg_steps(m)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            times[m].append(cfg_steps(m))
    med = {m: statistics.median(v) for m, v in times.items()}
    model.modulation_cache.set_mode("table")
    cfg_steps("table")
    table_bytes = model.modulation_cache.nbytes()
    flops = forward_flops(cfg, h * w, args.text_tokens)
    params = sum(p.numel() for p in model.parameters())
    mod_params = sum(p.numel() for n, p in model.named_parameters() if "_mod." in n)
    result = {
        "bench": "modulation_cache",
        "device": args.device,
        "dtype": args.dtype,
        "config": {"layers": args.layers, "dim": cfg.inner_dim, "image": args.size, "img_tokens": h * w},
        "ms_per_cfg_step": {m: round(v * 1e3, 2) for m, v in med.items()},
        "speedup_cfg_vs_off": round(med["off"] / med["cfg"], 3),
        "speedup_table_vs_off": round(med["off"] / med["table"], 3),
        "modulation_flop_share": round(flops["modulation"] / flops["total"], 5),
        "modulation_param_share": round(mod_params / params, 4),
        "table_bytes_per_step": table_bytes // args.steps,
        "table_mb_qwen_image_50_steps_bf16": round(60 * 50 * 2 * 6 * 3072 * 2 / 1e6, 1),
    }
    print(f"{'mode':<8}{'ms / CFG step':>16}{'vs off':>10}")
    for m in modes:
        print(f"{m:<8}{med[m] * 1e3:>16.2f}{med['off'] / med[m]:>10.3f}")
    print(
        f"modulation: {result['modulation_flop_share']:.3%} of forward FLOPs, "
        f"{result['modulation_param_share']:.1%} of parameters (weights read every forward)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
