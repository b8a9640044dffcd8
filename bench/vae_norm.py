"""The VAE's channel RMS norm written as sum + rsqrt against `F.normalize`, side by side in one run.

Times forward + backward of the norm alone at the tiny VAE's activation shapes, and one whole
training step of the tiny VAE (16 crops of 64x64, the recipe's VAE stage on one process) with each
norm, interleaved round after round so machine noise hits both alike. Also reports the largest
difference between the two outputs. Times are CPU time of this process (`time.process_time`), which
other tenants of a shared machine do not inflate. A short report, then one JSON line.

    python bench/vae_norm.py [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The recipe is a folder of the repository (not installed): importable from its root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.model.qwen_image.vae import QwenImageVAE  # noqa: E402
from ditfleet.model.qwen_image.vae_blocks import RMSNorm  # noqa: E402
from recipes.tiny.train_vae import VAETrainConfig, reconstruct, reconstruction_loss  # noqa: E402

SHAPES = ((8, 16, 64, 64), (8, 32, 32, 32), (8, 64, 16, 16))


def normalize_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The norm as it was: F.normalize's vector-norm kernel."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    return F.normalize(x.float() if low else x, dim=1).to(x.dtype) * self.scale * self.gamma


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    variants = {"F.normalize": normalize_forward, "sum+rsqrt": RMSNorm.forward}

    results: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    differences: dict[str, float] = {}
    for shape in SHAPES:
        norm = RMSNorm(shape[1], video_gamma=False)
        x = torch.randn(shape, requires_grad=True)
        outs = {name: fn(norm, x) for name, fn in variants.items()}
        differences[str(shape)] = float((outs["F.normalize"] - outs["sum+rsqrt"]).detach().abs().max())
        for _ in range(args.rounds):
            for name, fn in variants.items():
                ms = _timed(lambda fn=fn, norm=norm, x=x: fn(norm, x).sum().backward(), 20)
                results[name].setdefault(str(shape), []).append(ms)

    config = VAETrainConfig()
    vae = QwenImageVAE(config.vae_config()).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-4)
    x = torch.rand(config.batch_size, 3, config.crop, config.crop) * 2 - 1
    original = RMSNorm.forward

    def step() -> None:
        recon, mean, logvar = reconstruct(vae, x, sample=False)
        loss = reconstruction_loss(recon, x, config.edge_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    try:
        for _ in range(args.rounds):
            for name, fn in variants.items():
                RMSNorm.forward = fn
                results[name].setdefault("vae_train_step", []).append(_timed(step, 3))
    finally:
        RMSNorm.forward = original

    summary = {"threads": args.threads, "rounds": args.rounds, "max_abs_difference": differences}
    for key in results["F.normalize"]:
        before = statistics.median(results["F.normalize"][key])
        after = statistics.median(results["sum+rsqrt"][key])
        print(f"{key:>18}: F.normalize {before:8.2f} ms   sum+rsqrt {after:8.2f} ms   {before / after:.2f}x")
        summary[key] = {
            "F.normalize_ms": round(before, 2),
            "sum+rsqrt_ms": round(after, 2),
            "speed_up": round(before / after, 2),
        }
    print(f"largest output difference: {max(differences.values()):.1e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
