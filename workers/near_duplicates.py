"""Near-duplicate images counted from their 64-bit perceptual hashes, column-wise in numpy.

    counts = count_near_duplicates(hashes, prompt_digests)   # uint64 arrays, in output order
    counts.same_prompt, counts.across_prompts

An image counts when an earlier image (earlier in the arrays' order) is within
NEAR_DUPLICATE_BITS bits of it: as `same_prompt` when one such earlier image has its prompt
(another seed of it), else as `across_prompts`. Each image counts at most once, so the counts
are images that repeat something already there, not pairs.

Finding the pairs: the 64 bits are cut into 8 bands of 8 bits. Two hashes within 6 bits differ
in at most 6 bands, so they agree exactly on at least 2 of the 8: every such pair shares the
16-bit key of one of the 28 pairs of bands (pigeonhole). Per band pair, a sort by that key puts
the candidates next to each other; each candidate pair is compared once there (popcount of the
xor). Work is one sort of the images per band pair plus the candidate pairs: for hashes spread
evenly, 28 * n^2 / 2 / 65536 of them (0.2 billion at a million images); hashes that cluster (a
job of near-identical images) make more, up to every pair in a cluster. Memory: 16 bytes per
image held (the hash and its prompt's digest) and about 20 more while a band pair is sorted.

Prompts are compared by 64-bit digests (workers.value_digests): two different prompts with the
same digest (a chance of about 2^-64 per pair) would count as one prompt.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

#: Two images whose hashes differ in at most this many bits count as near duplicates.
NEAR_DUPLICATE_BITS = 6

_BANDS = 8
_BAND_BITS = 64 // _BANDS
# Hashes within NEAR_DUPLICATE_BITS agree on at least _BANDS - NEAR_DUPLICATE_BITS bands; the
# lookup below keys on pairs of bands, so it needs two.
assert _BANDS - NEAR_DUPLICATE_BITS >= 2, "the band-pair keys find every pair only up to 6 bits"
_BAND_PAIRS = tuple(itertools.combinations(range(_BANDS), 2))  # 28


@dataclass(frozen=True)
class NearDuplicateCounts:
    images: int  # images looked at (each with a hash)
    same_prompt: int  # near an earlier image of the same prompt (another seed)
    across_prompts: int  # near an earlier image only of other prompts

    def to_dict(self) -> dict[str, int]:
        return {"images": self.images, "same_prompt": self.same_prompt, "across_prompts": self.across_prompts}


def _band(hashes: np.ndarray, band: int) -> np.ndarray:
    return ((hashes >> np.uint64(band * _BAND_BITS)) & np.uint64(0xFF)).astype(np.uint16)


def count_near_duplicates(hashes: np.ndarray, prompt_digests: np.ndarray) -> NearDuplicateCounts:
    """hashes: (n,) 64-bit pHashes (uint64, or int64 as the manifest stores them); prompt_digests:
    (n,) uint64, one per image. See the module for what counts and what it costs."""
    hashes = np.ascontiguousarray(hashes).view(np.uint64)
    if hashes.ndim != 1 or prompt_digests.shape != hashes.shape:
        raise ValueError(
            f"count_near_duplicates takes one hash and one prompt digest per image, got shapes "
            f"{hashes.shape} and {prompt_digests.shape}"
        )
    n = len(hashes)
    near = np.zeros(n, bool)  # has an earlier image within the bits
    near_same = np.zeros(n, bool)  # ... of its own prompt
    bands = [_band(hashes, b) for b in range(_BANDS)]  # 8 x (n,) uint16
    for a, b in _BAND_PAIRS:
        keys = (bands[a] << np.uint16(_BAND_BITS)) | bands[b]  # (n,) uint16
        order = np.argsort(keys, kind="stable")  # equal keys stay in output order
        sorted_keys = keys[order]
        # Candidates at distance `step` in sorted order: positions whose key equals the key
        # `step` further on. A run of equal keys shrinks by one each step, so the work is the
        # candidate pairs themselves, and the loop ends with the longest run.
        starts = np.arange(n - 1)
        step = 1
        while len(starts):
            starts = starts[starts + step < n]
            starts = starts[sorted_keys[starts] == sorted_keys[starts + step]]
            earlier, later = order[starts], order[starts + step]  # stable: earlier < later
            close = np.bitwise_count(hashes[earlier] ^ hashes[later]) <= NEAR_DUPLICATE_BITS
            later = later[close]
            near[later] = True
            near_same[later[prompt_digests[earlier[close]] == prompt_digests[later]]] = True
            step += 1
    same = int(near_same.sum())
    return NearDuplicateCounts(images=n, same_prompt=same, across_prompts=int(near.sum()) - same)
