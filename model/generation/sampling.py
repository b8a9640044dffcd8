"""The sampler as plain functions: noise, packing, true CFG and the denoising loop.

Latents: 16 channels at 1/8 of the image size, packed 2x2 into 64-channel tokens in [C][dy][dx]
order, so an H x W image is (H/16) * (W/16) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ditfleet.model.generation.scheduler import SchedulerConfig, euler_step, sigma_schedule

if TYPE_CHECKING:
    from ditfleet.model.generation.components import Denoiser
    from ditfleet.model.generation.step_cache import StepCache

LATENT_CHANNELS = 16


def latent_grid(height: int, width: int) -> tuple[int, int]:
    """(h, w) of the packed token grid for an image size; sizes must be multiples of 16."""
    if height % 16 or width % 16:
        raise ValueError(f"height and width must be multiples of 16, got {width}x{height}")
    return height // 16, width // 16


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) -> (B, h*w, C*4), channel-major within each 2x2 patch."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C*4) -> (B, C, 2h, 2w); inverse of pack_latents."""
    B, N, C4 = tokens.shape
    x = tokens.view(B, h, w, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, C4 // 4, h * 2, w * 2)


def initial_noise(seeds: list[int], height: int, width: int, device, dtype: torch.dtype) -> torch.Tensor:
    """Packed noise (B, N, 64), one CPU generator per image.

    Drawn in fp32 on the CPU with shape (1, 1, 16, H/8, W/8) per seed, exactly what the reference
    pipeline draws with `torch.Generator().manual_seed(seed)`, so a seed means the same image
    whatever the batch, the actor, the device or the dtype.
    """
    h, w = latent_grid(height, width)
    per_image = []
    for seed in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        z = torch.randn((1, 1, LATENT_CHANNELS, 2 * h, 2 * w), generator=g, dtype=torch.float32)
        per_image.append(pack_latents(z[:, 0]))
    return torch.cat(per_image).to(device=device, dtype=dtype)


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """neg + s * (cond - neg), rescaled per token to the norm of cond. cond/uncond (B, N, C)."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(cond.dtype).view(-1, 1, 1)
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / comb_norm)


def model_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scheduler's t in [0, 1000] -> what the transformer takes, t / 1000 in `dtype`.

    Rounded to `dtype` first, then divided in `dtype`, exactly as the reference pipeline does
    (`t.to(latents.dtype) / 1000`): in bf16 dividing first and rounding after lands on another
    value for some steps (t = 392.6 gives 0.3906 instead of 0.3926), and the DiT output there
    differs by tens of percent, so the trajectory leaves the reference's.
    """
    return t.to(dtype) / 1000.0


@dataclass
class Conditioning:
    embeds: torch.Tensor  # (B, L, D)
    mask: torch.Tensor | None  # (B, L) or None when nothing is padded


class TimestepBank:
    """One timestep tensor per (schedule, step), kept across requests.

    In "table" modulation-cache mode the transformer keys its per-step modulation by the identity
    of the timestep tensor, so the pipeline must hand it the very same tensor for the same step of
    the same schedule every time.
    """

    def __init__(self) -> None:
        self._bank: dict[tuple, list[torch.Tensor]] = {}

    def get(self, sigmas: torch.Tensor, key: tuple, device, dtype) -> list[torch.Tensor]:
        full_key = (key, str(device), dtype)
        if full_key not in self._bank:
            ts = (sigmas[:-1] * 1000.0).to(device)  # the scheduler's t in [0, 1000]
            self._bank[full_key] = [model_timestep(ts[i : i + 1], dtype) for i in range(ts.shape[0])]
        return self._bank[full_key]

    def clear(self) -> None:
        self._bank.clear()


class PrepareInputs(Protocol):
    """A family's DiT inputs for one call of the shared loop, as the keyword arguments its
    denoiser takes (flux's `prepare`): the loop never names them."""

    def __call__(
        self,
        latents: torch.Tensor,  # (B, N, 64) packed
        embeds: torch.Tensor,  # (B, L, D) the text
        mask: torch.Tensor | None,  # (B, L), 1 = real token; None: no padding
        timestep: torch.Tensor,  # what the model takes, t / 1000 (model_timestep)
        grid: tuple[int, int],  # the latent grid (h, w) in packed tokens
    ) -> dict[str, Any]: ...


def denoise(
    transformer: Denoiser,
    prepare: PrepareInputs,
    latents: torch.Tensor,  # (B, N, 64)
    cond: Conditioning,
    uncond: Conditioning | None,
    true_cfg_scale: float | torch.Tensor,
    grid: tuple[int, int],
    steps: int,
    scheduler: SchedulerConfig,
    cfg_batched: bool = False,
    timestep_bank: TimestepBank | None = None,
    step_cache: StepCache | None = None,
) -> torch.Tensor:
    """Run the flow-match Euler loop; returns latents (B, N, 64) in the input dtype.

    prepare: the family's DiT inputs for each call (model.qwen_image.transformer.prepare_inputs);
    the loop hands the denoiser what it returns, by name, and knows none of its arguments.

    cfg_batched: the conditional and unconditional passes of a step run as one forward of 2B
    (text padded to the longer branch); else as two forwards of B. Either way the step's
    modulation is computed once: one forward, or a cache hit in the second.
    step_cache: reuses block work per image and CFG branch (model.generation.step_cache); each call names
    the branches it carries. None: every block computes.
    """
    h, w = grid
    image_seq_len = h * w
    sigmas = sigma_schedule(scheduler, steps, image_seq_len).to(latents.device)
    ts = sigmas[:-1] * 1000.0  # the scheduler's t in [0, 1000]; the model takes t / 1000
    bank_steps = None
    if timestep_bank is not None:
        bank_steps = timestep_bank.get(
            sigmas, (steps, image_seq_len, scheduler), latents.device, latents.dtype
        )
    if step_cache is not None:
        step_cache.start(steps, latents.shape[0])
    # One joined batch for every step: the same mask tensor each step, so the DiT reads its
    # padding from the device once per batch (model.qwen_image.attention.padding_facts), not per step.
    both_text = _cat_branches(cond, uncond) if uncond is not None and cfg_batched else None
    for i in range(steps):
        # The same tensor object goes to both CFG passes of this step: that is the cache key.
        if bank_steps is not None:
            timestep = bank_steps[i]
        else:
            timestep = model_timestep(ts[i : i + 1], latents.dtype)
        forward = partial(_forward, transformer, step_cache, i)
        if uncond is None:
            velocity = forward((0,), prepare(latents, cond.embeds, cond.mask, timestep, grid))
        elif both_text is not None:
            embeds, mask = both_text
            both = forward((0, 1), prepare(torch.cat([latents, latents]), embeds, mask, timestep, grid))
            c, u = both.chunk(2)
            velocity = true_cfg(c, u, true_cfg_scale)
        else:
            c = forward((0,), prepare(latents, cond.embeds, cond.mask, timestep, grid))
            u = forward((1,), prepare(latents, uncond.embeds, uncond.mask, timestep, grid))
            velocity = true_cfg(c, u, true_cfg_scale)
        latents = euler_step(latents, velocity, sigmas[i], sigmas[i + 1])
    return latents


def _forward(
    transformer: Denoiser,
    step_cache: StepCache | None,
    step: int,
    branches: tuple[int, ...],
    inputs: dict[str, Any],
) -> torch.Tensor:
    """One transformer call of step `step` carrying the CFG branches `branches` (0 conditional,
    1 unconditional) with the inputs the family prepared, served by the step cache when one is active."""
    rows = None if step_cache is None else step_cache.call(step, branches)
    return transformer(**inputs) if rows is None else transformer(**inputs, step_cache=rows)


def _cat_branches(a: Conditioning, b: Conditioning) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both branches as one batch (2B, max(La, Lb), D), the shorter padded on the right, and its
    mask (None when neither branch is padded)."""
    length = max(a.embeds.shape[1], b.embeds.shape[1])
    if a.mask is None and b.mask is None and a.embeds.shape[1] == b.embeds.shape[1]:
        return torch.cat([a.embeds, b.embeds]), None
    embeds, masks = [], []
    for c in (a, b):
        B, L, _ = c.embeds.shape
        mask = c.mask if c.mask is not None else torch.ones(B, L, dtype=torch.long, device=c.embeds.device)
        embeds.append(torch.nn.functional.pad(c.embeds, (0, 0, 0, length - L)))
        masks.append(torch.nn.functional.pad(mask.long(), (0, length - L)))
    return torch.cat(embeds), torch.cat(masks)
