"""uint8 RGB pixels as float64 luma in [0, 1], one image at a time on the CPU.

Both weight-free scorers start here. The CPU and float64 make a score the same on any device and
for a PNG read back: a GPU's reductions may sum in another order and differ in the last bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: ITU-R BT.601 luma weights for R, G, B.
BT601 = (0.299, 0.587, 0.114)


def check_pixels(pixels: torch.Tensor) -> None:
    """Raise ValueError unless pixels is a (B, 3, H, W) uint8 tensor."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 4 or pixels.shape[1] != 3:
        raise ValueError(
            f"image scorers take (B, 3, H, W) uint8 pixels, got {tuple(pixels.shape)} "
            f"{pixels.dtype}: pass the decoded image as stored (uint8 RGB, channels first)"
        )


def score_each(
    name: str, pixels: torch.Tensor, prompts: Sequence[str], one: Callable[[torch.Tensor, str], float]
) -> list[float]:
    """`one(image, prompt)` for each (3, H, W) uint8 image of the batch: a scorer whose images
    score one at a time, so a score never depends on the batch. ValueError for a wrong batch."""
    check_pixels(pixels)
    if len(prompts) != pixels.shape[0]:
        raise ValueError(
            f"{name} got {pixels.shape[0]} images and {len(prompts)} prompts: pass one prompt per image"
        )
    return [one(image, prompt) for image, prompt in zip(pixels, prompts)]


def luma(image: torch.Tensor) -> torch.Tensor:
    """One (3, H, W) uint8 image -> (H, W) float64 luma in [0, 1] on the CPU."""
    rgb = image.detach().to("cpu", torch.float64) / 255.0  # (3, H, W)
    r, g, b = BT601
    return r * rgb[0] + g * rgb[1] + b * rgb[2]  # (H, W)
