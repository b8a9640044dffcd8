"""Helpers shared by the compile tests: small buckets, random prompt embeddings, a second VAE."""

from __future__ import annotations

from pathlib import Path

import torch

from ditfleet.compile import ResolutionBucket

# The smallest sizes the tiny model supports with 2x2 packing: latent grids 4x4 and 6x4. Each
# costs one Inductor graph of the VAE decode (tens of seconds on 2 CPU cores).
SMALL_BUCKETS = (ResolutionBucket(32, 32), ResolutionBucket(48, 32))


def random_embeds(pipe, batch: int, length: int, seed: int, real: int | None = None):
    """(embeds (B, L, D), mask (B, L) long) with the first `real` tokens real (all if None)."""
    g = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    embeds = torch.randn(batch, length, dim, generator=g).to(pipe.device, pipe.dtype)
    mask = torch.zeros(batch, length, dtype=torch.long, device=embeds.device)
    mask[:, : length if real is None else real] = 1
    return embeds, mask


def generate(pipe, bucket: ResolutionBucket, inputs: dict, seeds=(7,), steps: int = 2, cfg: float = 4.0):
    """Images (B, 3, H, W) for generate() keyword inputs such as pad_guidance_inputs' result."""
    return pipe.generate(
        **inputs, height=bucket.height, width=bucket.width, steps=steps, true_cfg_scale=cfg, seeds=list(seeds)
    )


def velocity(
    pipe, latents: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor | None, grid, t: float = 0.7
):
    """One DiT forward: packed latents (B, N, 64) -> velocity (B, N, 64)."""
    timestep = torch.full((1,), t, dtype=pipe.dtype, device=pipe.device)
    h, w = grid
    with torch.no_grad():
        return pipe.transformer(latents, embeds, mask, timestep, [[(1, h, w)]] * latents.shape[0])


def perturbed_vae(model_dir: Path, seed: int = 1):
    """The model's VAE loaded again as a new object, with every weight nudged (other outputs)."""
    from ditfleet.model.qwen_image.vae import load_vae

    vae = load_vae(Path(model_dir) / "vae")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return vae
