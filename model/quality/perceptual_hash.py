"""A 64-bit DCT perceptual hash (pHash) per image (near duplicates: workers.near_duplicates).

pHash: luma, area-resized to 32x32, 2-D DCT-II, and the 8x8 lowest frequencies compared with
their median (the DC term left out of the median: it is the mean brightness, far above the rest).
Bit 63 is coefficient (0, 0), bit 0 is (7, 7), row-major. Similar images differ in few bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .luma import check_pixels, luma

_SIDE = 32  # the resized image
_LOW = 8  # the low-frequency block kept: 8 x 8 = 64 bits


def _dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (n, n) in float64: coefficients = D @ x."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2.0 * i + 1.0) * k / (2.0 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


_DCT = _dct_matrix(_SIDE)


def phash_one(y: torch.Tensor) -> int:
    """The 64-bit pHash of one (H, W) float64 luma image."""
    small = F.interpolate(y[None, None], size=(_SIDE, _SIDE), mode="area")[0, 0]  # (32, 32)
    low = (_DCT @ small @ _DCT.T)[:_LOW, :_LOW].flatten()  # (64,)
    bits = (low > low[1:].median()).tolist()  # bit 63 first
    return int("".join("1" if b else "0" for b in bits), 2)


def perceptual_hashes(pixels: torch.Tensor) -> list[int]:
    """(B, 3, H, W) uint8 -> one 64-bit pHash per image, each computed alone."""
    check_pixels(pixels)
    return [phash_one(luma(image)) for image in pixels]


def hamming(a: int, b: int) -> int:
    """The number of bits in which two hashes differ."""
    return (a ^ b).bit_count()
