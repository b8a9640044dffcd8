"""Stage 3 of the tiny model: the VAE decoder adapted to the latents the DiT actually draws.

Why: the DiT's sampled latents differ from the encoder's latents of the same scene by a small,
high-frequency error concentrated on the shape (RMS 0.14 in normalised units against 1.0 for the
latents, measured on 64 training captions at 128x128). Decoded by the stage-1 decoder that error
rounds a square's corners or frays a triangle's outline: the true latents decode to the right kind
every time, the true latents plus the DiT's error 80% of the time, the true latents plus Gaussian
noise of the same RMS 100% of the time. So the decoder is trained on the distribution it will be
handed: latents sampled from the trained DiT for training captions, with the job's sampler (20
steps, CFG 2, random seeds), each paired with the ideal scene its caption names (centred in its
cell, as the DiT's second phase learned it). On the held-out captions (12 steps, CFG 2; 128x128 /
160x96 / 96x160) the bundled DiT went from kind 75/67/69% to 77/72/77%, one clean blob 92/78/83%
to 98/92/91%, IoU 0.89/0.85/0.86 to 0.91/0.89/0.89. Twice the steps (1,600) gave the same.

Only the decoder and post_quant_conv train: the encoder and the latent statistics stay as the DiT
learned them. The loss is the VAE stage's (L1 + MSE, outline band weighted) on 64x64 crops around
the shape (the background needs no adapting, and crops are ~3x cheaper than whole images); a quarter
of every batch decodes the encoder's own latents of the same scenes, so plain reconstruction (and
every other caller of the decoder) keeps working.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ditfleet.model.generation.pipeline import TextToImagePipeline
from ditfleet.model.generation.sampling import latent_grid, unpack_latents
from ditfleet.model.qwen_image.vae import QwenImageVAE
from ditfleet.model.tiny.scenes import TINY_BUCKETS, Scene, render_batch, shape_geometry
from recipes.tiny.data_parallel import SINGLE_PROCESS, Shard
from recipes.tiny.train_vae import reconstruction_loss


@dataclass(frozen=True)
class DecoderTrainConfig:
    steps: int = 800
    # DiT samples per bucket (split over the processes), each a training caption with a random seed.
    pairs_per_bucket: int = 768
    # The sampler the README job uses.
    sample_steps: int = 20
    true_cfg_scale: float = 2.0
    sample_batch: int = 32
    batch_size: int = 16
    # Constant: the decoder starts trained; 400 -> 800 steps still improved the held-out outlines,
    # 800 -> 1,600 did not.
    lr: float = 2e-4
    # Share of each batch decoded from the encoder's latents instead of the DiT's.
    true_latent_fraction: float = 0.25
    # Crop side in latent positions (x8 pixels), and how far (in latent positions) a crop's origin
    # moves off the shape's centre.
    crop: int = 8
    crop_offset: int = 2


@dataclass
class DecoderPairs:
    """One bucket's training pairs: DiT latents and the encoder's, the ideal images, shape centres."""

    sampled: torch.Tensor  # (N, 16, h, w) raw (denormalised) latents from the DiT
    encoded: torch.Tensor  # (N, 16, h, w) the encoder's posterior means of `images`
    images: torch.Tensor  # (N, 3, H, W) in [-1, 1]
    centres: torch.Tensor  # (N, 2) shape centre (x, y) in pixels


@torch.no_grad()
def sample_pairs(
    pipe: TextToImagePipeline,
    scenes: list[Scene],
    config: DecoderTrainConfig,
    generator: torch.Generator,
    shard: Shard = SINGLE_PROCESS,
) -> list[DecoderPairs]:
    """This process's share of the pairs, one `DecoderPairs` per bucket of TINY_BUCKETS."""
    per_bucket = shard.part(config.pairs_per_bucket, "decoder pairs per bucket")
    vae = pipe.vae
    out = []
    for width, height in TINY_BUCKETS:
        chosen = [scenes[i] for i in torch.randint(len(scenes), (per_bucket,), generator=generator).tolist()]
        seeds = torch.randint(1 << 30, (per_bucket,), generator=generator).tolist()
        sampled = []
        for start in range(0, per_bucket, config.sample_batch):
            chunk = chosen[start : start + config.sample_batch]
            packed = pipe.generate(
                prompt=[s.caption for s in chunk],
                height=height,
                width=width,
                steps=config.sample_steps,
                true_cfg_scale=config.true_cfg_scale,
                seeds=seeds[start : start + len(chunk)],
                decode=False,
            )
            z = unpack_latents(packed.float(), *latent_grid(height, width))
            sampled.append(vae.denormalize(z))
        images = render_batch(chosen, width, height) * 2.0 - 1.0
        centres = torch.tensor([shape_geometry(s, width, height)[:2] for s in chosen], dtype=torch.float32)
        out.append(DecoderPairs(torch.cat(sampled), vae.encode(images), images, centres))
    return out


def crop_around_shapes(
    pairs: DecoderPairs,
    index: torch.Tensor,
    use_encoded: torch.Tensor,
    config: DecoderTrainConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent crops (B, 16, c, c), image crops (B, 3, 8c, 8c)) around the shapes of `index`;
    `use_encoded` (B,) bool picks the encoder's latent instead of the DiT's."""
    c, h, w = config.crop, pairs.sampled.shape[2], pairs.sampled.shape[3]
    scale = pairs.images.shape[2] // h  # pixels per latent position (the VAE's downsampling)
    offsets = torch.randint(-config.crop_offset, config.crop_offset + 1, (len(index), 2), generator=generator)
    latents, images = [], []
    for i, encoded, (dx, dy) in zip(index.tolist(), use_encoded.tolist(), offsets.tolist()):
        cx, cy = pairs.centres[i].tolist()
        x0 = min(max(int(cx // scale) - c // 2 + dx, 0), w - c)
        y0 = min(max(int(cy // scale) - c // 2 + dy, 0), h - c)
        source = pairs.encoded if encoded else pairs.sampled
        latents.append(source[i, :, y0 : y0 + c, x0 : x0 + c])
        images.append(pairs.images[i, :, y0 * scale : (y0 + c) * scale, x0 * scale : (x0 + c) * scale])
    return torch.stack(latents), torch.stack(images)


def adapt_decoder(
    config: DecoderTrainConfig,
    pipe: TextToImagePipeline,
    scenes: list[Scene],
    generator: torch.Generator,
    edge_weight: float,
    log: Callable[[str], None] = print,
    shard: Shard = SINGLE_PROCESS,
) -> QwenImageVAE:
    """Fine-tune `pipe.vae`'s decoder in place on DiT samples of `scenes`; returns the VAE in eval mode.
    edge_weight: the VAE stage's outline weight (the same loss)."""
    vae: QwenImageVAE = pipe.vae
    start = time.time()
    pairs = sample_pairs(pipe, scenes, config, generator, shard)
    log(
        f"decoder pairs per process: {[tuple(p.sampled.shape) for p in pairs]} sampled in {time.time() - start:.0f}s"
    )
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.99))
    batch_size = shard.part(config.batch_size, "decoder batch size")
    encoded_count = round(batch_size * config.true_latent_fraction)
    use_encoded = torch.arange(batch_size) < encoded_count
    vae.decoder.train()
    running = None
    for step in range(config.steps):
        bucket = pairs[step % len(pairs)]
        index = torch.randint(bucket.sampled.shape[0], (batch_size,), generator=generator)
        z, x = crop_around_shapes(bucket, index, use_encoded, config, generator)
        loss = reconstruction_loss(vae.decoder(vae.post_quant_conv(z)), x, edge_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        shard.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 100 == 0 or step == config.steps - 1:
            log(f"decoder step {step:5d}  rec {running:.4f}  {time.time() - start:6.0f}s")
    vae.eval()
    return vae
