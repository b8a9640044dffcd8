"""Near duplicates counted from pHashes (workers.near_duplicates) against the definition, brute force."""

from __future__ import annotations

import numpy as np
import pytest

from ditfleet.workers.near_duplicates import NEAR_DUPLICATE_BITS, count_near_duplicates


def _brute_force(hashes: list[int], prompts: list[int]) -> tuple[int, int]:
    """(same_prompt, across_prompts) by the module's definition, comparing every earlier image."""
    same = across = 0
    for i, h in enumerate(hashes):
        near = [j for j in range(i) if (h ^ hashes[j]).bit_count() <= NEAR_DUPLICATE_BITS]
        if any(prompts[j] == prompts[i] for j in near):
            same += 1
        elif near:
            across += 1
    return same, across


def _count(hashes: list[int], prompts: list[int]) -> tuple[int, int]:
    counts = count_near_duplicates(np.array(hashes, np.uint64), np.array(prompts, np.uint64))
    assert counts.images == len(hashes)
    return counts.same_prompt, counts.across_prompts


def test_same_prompt_is_told_from_across_prompts() -> None:
    base = 0x0123_4567_89AB_CDEF
    near = base ^ 0b11_1111  # 6 bits, in one band
    spread = base ^ sum(1 << (8 * band) for band in range(6))  # 6 bits, one per band: 2 bands agree
    far = base ^ ((1 << 7) - 1) << 20  # 7 bits
    cat, dog, cow = 1, 2, 3
    # r1: another seed of cat; r2: a near copy under dog; r3: near r0 (cat) and r2 (dog): its own
    # prompt wins; r4: 7+ bits from everything.
    hashes = [base, near, spread, base, far ^ (1 << 63) ^ (1 << 62)]
    assert _count(hashes, [cat, cat, dog, dog, cow]) == (2, 1)


def test_every_pair_the_brute_force_finds_is_found_in_clusters() -> None:
    rng = np.random.default_rng(1)
    centres = [int(c) for c in rng.integers(0, 2**63, 60)]
    hashes, prompts = [], []
    for _ in range(600):  # clusters: 0 to 8 bits from a centre, so pairs on both sides of 6 bits
        h = centres[int(rng.integers(0, len(centres)))]
        for bit in rng.choice(64, int(rng.integers(0, 9)), replace=False):
            h ^= 1 << int(bit)
        hashes.append(h)
        prompts.append(int(rng.integers(0, 40)))
    same, across = _count(hashes, prompts)
    assert (same, across) == _brute_force(hashes, prompts)
    assert same > 0 and across > 0 and same + across < len(hashes)


def test_int64_hashes_as_the_manifest_stores_them_count_the_same() -> None:
    hashes = np.array([2**64 - 1, 2**64 - 1 ^ 0b111, 5], np.uint64)
    prompts = np.array([7, 8, 7], np.uint64)
    as_stored = count_near_duplicates(hashes.view(np.int64), prompts)
    assert as_stored == count_near_duplicates(hashes, prompts)
    assert (as_stored.same_prompt, as_stored.across_prompts) == (0, 1)


def test_no_images_and_one_image_count_nothing() -> None:
    assert _count([], []) == (0, 0)
    assert _count([42], [1]) == (0, 0)


def test_mismatched_arrays_are_refused_with_their_shapes() -> None:
    with pytest.raises(ValueError, match=r"one hash and one prompt digest per image.*\(3,\) and \(2,\)"):
        count_near_duplicates(np.zeros(3, np.uint64), np.zeros(2, np.uint64))
