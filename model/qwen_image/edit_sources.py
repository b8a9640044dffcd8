"""An edit model's source images as the DiT takes them: resized to the VAE's source size, encoded,
normalised and packed into latent tokens (model.qwen_image.edit says which sizes).

What diffusers' `QwenImageEditPlusPipeline` does to `image` before its denoising loop: each source
resized (PIL, Lanczos) to `source_size` of its own aspect ratio, scaled to [-1, 1], VAE-encoded
(the posterior's mean: `sample_mode="argmax"`), normalised with the VAE's latent mean and std, and
packed 2 x 2; the sources of a row follow each other in its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ditfleet.model.qwen_image.edit import EditStyle

if TYPE_CHECKING:
    from PIL.Image import Image  # the one module of model/ that names Pillow (a core dependency)

    from ditfleet.model.qwen_image.vae import QwenImageVAE

# Pixels per packed latent token side: the VAE's 8x and the DiT's 2 x 2 patches.
TOKEN_PIXELS = 16


def resized(image: Image, size: tuple[int, int]) -> Image:
    """`image` as RGB at (width, height) `size`, Lanczos as diffusers' VaeImageProcessor.resize;
    the image itself when it already is."""
    from PIL import Image as PILImage

    rgb = image if image.mode == "RGB" else image.convert("RGB")
    width, height = size
    return (
        rgb
        if rgb.size == (width, height)
        else rgb.resize((width, height), resample=PILImage.Resampling.LANCZOS)
    )


def pixels(image: Image) -> torch.Tensor:
    """An RGB PIL image -> (3, H, W) float32 in [-1, 1]: its uint8 levels / 255, then 2x - 1
    (diffusers' VaeImageProcessor.preprocess, without numpy)."""
    width, height = image.size
    levels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return levels.permute(2, 0, 1).to(torch.float32) / 255.0 * 2.0 - 1.0


def source_grids(sources: Sequence[Image], style: EditStyle) -> tuple[tuple[int, int], ...]:
    """Each source's token grid (h, w) at its VAE source size."""
    return tuple(_grid(style.vae_size(*image.size)) for image in sources)


def _grid(size: tuple[int, int]) -> tuple[int, int]:
    width, height = size
    return height // TOKEN_PIXELS, width // TOKEN_PIXELS


def check_batch(sources: Sequence[Sequence[Image]], style: EditStyle) -> tuple[tuple[int, int], ...]:
    """The grids every row of a batch shares; a row whose sources differ in number or size from
    the first row's is refused (one DiT call takes one sequence length)."""
    if not sources:
        raise ValueError("sources: no rows")
    first = source_grids(sources[0], style)
    for i, row in enumerate(sources):
        grids = source_grids(row, style)
        if grids != first:
            raise ValueError(
                f"sources: row {i} has source grids {list(grids)} but row 0 has {list(first)}; a batch's "
                "rows must share their sources' number and sizes (group rows by the family's `source_size`)."
            )
    return first


@torch.no_grad()
def encode_sources(
    vae: QwenImageVAE, sources: Sequence[Sequence[Image]], style: EditStyle, device: torch.device
) -> tuple[list[torch.Tensor], tuple[tuple[int, int], ...]]:
    """(each source's normalised latents (B, z_dim, 2h, 2w) in the VAE's dtype, each source's (h, w)
    token grid) for a batch whose rows share their sources' sizes (`check_batch`). The i-th
    sources of all rows are one VAE encode (`vae.encode`, what the compile region wraps)."""
    grids = check_batch(sources, style)
    vae_dtype = next(vae.parameters()).dtype
    latents = []
    for i, (h, w) in enumerate(grids):
        size = (w * TOKEN_PIXELS, h * TOKEN_PIXELS)
        x = torch.stack([pixels(resized(row[i], size)) for row in sources]).to(device, vae_dtype)
        latents.append(vae.normalize(vae.encode(x)))  # the posterior's mean (argmax)
    return latents, grids
