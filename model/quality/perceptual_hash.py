"""A 64-bit DCT perceptual hash (pHash) per image, and a counter of near-duplicate images.

pHash: luma, area-resized to 32x32, 2-D DCT-II, and the 8x8 lowest frequencies compared with
their median (the DC term left out of the median: it is the mean brightness, far above the rest).
Bit 63 is coefficient (0, 0), bit 0 is (7, 7), row-major. Similar images differ in few bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .luma import check_pixels, luma

_SIDE = 32  # the resized image
_LOW = 8  # the low-frequency block kept: 8 x 8 = 64 bits

#: Two images whose hashes differ in at most this many bits count as near duplicates.
NEAR_DUPLICATE_BITS = 6

# Near-duplicate lookup: the 64 bits cut into _BANDS bands. Two hashes within d bits differ in at
# most d bands, so with d < _BANDS they share at least one band exactly (pigeonhole): looking up
# each band finds every pair within NEAR_DUPLICATE_BITS, and the exact distance is then checked.
_BANDS = 8
_BAND_BITS = 64 // _BANDS
_BAND_MASK = (1 << _BAND_BITS) - 1
assert NEAR_DUPLICATE_BITS < _BANDS, "the banding finds every pair only below _BANDS bits"


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
    median = low[1:].median()
    value = 0
    for bit in (low > median).tolist():
        value = (value << 1) | int(bit)
    return value


def perceptual_hashes(pixels: torch.Tensor) -> list[int]:
    """(B, 3, H, W) uint8 -> one 64-bit pHash per image, each computed alone."""
    check_pixels(pixels)
    return [phash_one(luma(image)) for image in pixels]


def hamming(a: int, b: int) -> int:
    """The number of bits in which two hashes differ."""
    return (a ^ b).bit_count()


@dataclass
class NearDuplicates:
    """Counts images within `bits` of an earlier image, fed one at a time.

    An image near an earlier image of the same prompt (another seed) counts as `same_prompt`;
    otherwise, near one of another prompt, as `across_prompts`. Each image counts once. The work per
    image is its band lookups, each bucket holding the earlier images that share that band.
    """

    bits: int = NEAR_DUPLICATE_BITS
    same_prompt: int = 0
    across_prompts: int = 0
    _buckets: dict[tuple[int, int], list[tuple[str, str, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.bits < _BANDS:
            raise ValueError(
                f"NearDuplicates bits={self.bits}: the {_BANDS}-band lookup is exact for 0 to "
                f"{_BANDS - 1} bits; choose a threshold in that range"
            )

    def add(self, row_id: str, prompt: str, phash: int) -> str | None:
        """Record one image; return the row id of the earlier image it nearly duplicates, if any.

        A same-prompt match is preferred to a cross-prompt one.
        """
        keys = [(band, (phash >> (band * _BAND_BITS)) & _BAND_MASK) for band in range(_BANDS)]
        same: str | None = None
        other: str | None = None
        for key in keys:
            for earlier_id, earlier_prompt, earlier_hash in self._buckets.get(key, ()):
                if hamming(phash, earlier_hash) > self.bits:
                    continue
                if earlier_prompt == prompt and same is None:
                    same = earlier_id
                elif earlier_prompt != prompt and other is None:
                    other = earlier_id
        for key in keys:
            self._buckets.setdefault(key, []).append((row_id, prompt, phash))
        if same is not None:
            self.same_prompt += 1
            return same
        if other is not None:
            self.across_prompts += 1
        return other
