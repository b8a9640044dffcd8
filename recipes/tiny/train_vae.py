"""Stage 1 of the tiny model: the Qwen-Image VAE (our 2D class, tiny config) as a small KL autoencoder.

Loss per batch: L1 + MSE reconstruction in [-1, 1] of a decode from a *sampled* latent, plus a
light KL to a unit Gaussian. Sampling keeps the decoder tolerant of imprecise latents, which is what
the DiT will hand it; the KL keeps the latent smooth and its scale bounded. After training, the
per-channel mean and std of the posterior means over the data go into the config
(`latents_mean` / `latents_std`), exactly where diffusers' Qwen-Image VAE keeps them.

Training sees 64x64 crops around the shape (the nets are convolutional plus one attention at the
lowest resolution), which is four times cheaper than whole 128x128 images and spends no compute
on empty background.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditfleet.model.qwen_image.vae import QwenImageVAE, VAEConfig
from ditfleet.model.tiny.scenes import TINY_BUCKETS, Scene, render_batch, sample_batch, shape_geometry
from recipes.tiny.data_parallel import SINGLE_PROCESS, Shard


@dataclass(frozen=True)
class VAETrainConfig:
    base_dim: int = 16
    num_res_blocks: int = 1
    steps: int = 2000
    batch_size: int = 16
    crop: int = 64
    lr: float = 1e-3
    warmup: int = 50
    kl_weight: float = 1e-4
    # Reconstruction loss weight of the pixels within 2 of a shape's outline, on top of 1: the outline
    # is a few percent of the pixels but all that tells a small square or triangle from a circle.
    edge_weight: float = 8.0
    # Images used to measure latents_mean / latents_std (spread over all buckets).
    stats_images: int = 192

    def vae_config(self) -> VAEConfig:
        # Placeholder statistics: the real ones are measured after training.
        return VAEConfig(
            base_dim=self.base_dim,
            num_res_blocks=self.num_res_blocks,
            latents_mean=(0.0,) * 16,
            latents_std=(1.0,) * 16,
        )


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def crop_batch(scenes: list[Scene], batch_size: int, crop: int, generator: torch.Generator) -> torch.Tensor:
    """(B, 3, crop, crop) in [-1, 1]: random bucket, scenes and jitter; each crop holds its shape."""
    width, height = TINY_BUCKETS[int(torch.randint(len(TINY_BUCKETS), (1,), generator=generator))]
    chosen = [scenes[i] for i in torch.randint(len(scenes), (batch_size,), generator=generator).tolist()]
    jitters = torch.rand(batch_size, 2, generator=generator) * 2 - 1
    images = render_batch(chosen, width, height, jitters)  # (B, 3, H, W)
    # Crop origins: around each shape's centre with a random offset, clamped inside the image.
    offsets = torch.randint(-crop // 2 + 4, crop // 2 - 4, (batch_size, 2), generator=generator).tolist()
    out = []
    for image, scene, jitter, off in zip(images, chosen, jitters.tolist(), offsets):
        cx, cy, _ = shape_geometry(scene, width, height, (jitter[0], jitter[1]))
        x0 = int(min(max(cx - crop / 2 + off[0], 0), width - crop))
        y0 = int(min(max(cy - crop / 2 + off[1], 0), height - crop))
        out.append(image[:, y0 : y0 + crop, x0 : x0 + crop])
    return torch.stack(out) * 2.0 - 1.0


def outline_band(x: torch.Tensor) -> torch.Tensor:
    """x (B, 3, H, W) -> (B, 1, H, W) float: 1 where the colour changes within 2 pixels (the shape's
    anti-aliased outline and the pixels on both sides of it), else 0."""
    local_max = F.max_pool2d(x, 5, stride=1, padding=2)
    local_min = -F.max_pool2d(-x, 5, stride=1, padding=2)
    return ((local_max - local_min).abs().amax(dim=1, keepdim=True) > 0.05).float()


def reconstruction_loss(recon: torch.Tensor, x: torch.Tensor, edge_weight: float) -> torch.Tensor:
    """Mean of L1 + MSE per pixel, the outline band weighted `1 + edge_weight` (0: the plain mean).
    recon, x: (B, 3, H, W) in [-1, 1]."""
    weight = 1.0 + edge_weight * outline_band(x)  # (B, 1, H, W)
    error = (recon - x).abs() + (recon - x).pow(2)  # (B, 3, H, W)
    return (error * weight).sum() / (weight.sum() * x.shape[1])


def reconstruct(
    vae: QwenImageVAE, x: torch.Tensor, sample: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, 3, H, W) in [-1, 1] -> (reconstruction unclamped, mean, logvar)."""
    mean, logvar = vae.encode_moments(x)  # (B, 16, H/8, W/8) each
    z = mean
    if sample:
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        z = mean + torch.exp(0.5 * logvar) * eps
    assert vae.encoder is not None
    return (
        vae.decoder(vae.post_quant_conv(z)),
        mean,
        logvar,
    )  # decode() would clamp: no gradient outside [-1, 1]


def train_vae(
    config: VAETrainConfig,
    scenes: list[Scene],
    generator: torch.Generator,
    log: Callable[[str], None] = print,
    shard: Shard = SINGLE_PROCESS,
) -> QwenImageVAE:
    """Train from scratch (initialised from the global torch seed); returns the VAE in eval mode with its
    latent statistics in `vae.config`. Over several processes (`shard`), each takes its part of
    the batch from its own `generator` and the statistics are process 0's."""
    batch_size = shard.part(config.batch_size, "VAE batch size")
    vae = QwenImageVAE(config.vae_config())
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.99))
    start, running = time.time(), None
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config.steps, config.warmup, config.lr)
        x = crop_batch(scenes, batch_size, config.crop, generator)
        recon, mean, logvar = reconstruct(vae, x, sample=True, generator=generator)
        rec = reconstruction_loss(recon, x, config.edge_weight)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        loss = rec + config.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        shard.average_gradients(list(vae.parameters()))
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        stats = torch.tensor([rec.item(), kl.item()])
        running = stats if running is None else 0.95 * running + 0.05 * stats
        if step % 100 == 0 or step == config.steps - 1:
            log(
                f"vae step {step:5d}  rec {running[0]:.4f}  kl {running[1]:.3f}  lr {opt.param_groups[0]['lr']:.2e}  {time.time() - start:6.0f}s"
            )
    vae.eval()
    mean, std = (shard.broadcast(t) for t in latent_statistics(vae, scenes, config.stats_images, generator))
    vae.config = dataclasses.replace(
        vae.config, latents_mean=tuple(mean.tolist()), latents_std=tuple(std.tolist())
    )
    log(f"vae latents_mean {[round(v, 3) for v in mean.tolist()]}")
    log(f"vae latents_std  {[round(v, 3) for v in std.tolist()]}")
    return vae


@torch.no_grad()
def latent_statistics(
    vae: QwenImageVAE, scenes: list[Scene], n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (16,) of posterior means over `n` whole images from every bucket."""
    latents = []
    per_bucket = max(1, n // len(TINY_BUCKETS))
    for width, height in TINY_BUCKETS:
        images, _ = sample_batch(scenes, per_bucket, width, height, generator)
        z = vae.encode(images * 2.0 - 1.0)  # (B, 16, h, w)
        latents.append(z.permute(1, 0, 2, 3).reshape(16, -1))
    flat = torch.cat(latents, dim=1)  # (16, all positions)
    return flat.mean(dim=1), flat.std(dim=1).clamp_min(1e-3)


@torch.no_grad()
def reconstruction_error(vae: QwenImageVAE, scenes: list[Scene], n: int, generator: torch.Generator) -> float:
    """Mean absolute error in [0, 1] units of decode(encode(x)) on whole 128x128 images."""
    images, _ = sample_batch(scenes, n, 128, 128, generator)
    recon = vae.decode(vae.encode(images * 2.0 - 1.0)) / 2.0 + 0.5
    return float((recon - images).abs().mean())
