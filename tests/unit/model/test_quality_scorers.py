"""The weight-free image scorers: Laplacian sharpness and the DCT perceptual hash."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ditfleet.model.quality import scorer
from ditfleet.model.quality.perceptual_hash import hamming, perceptual_hashes
from ditfleet.model.quality.sharpness import Sharpness
from ditfleet.workers.near_duplicates import NEAR_DUPLICATE_BITS


def _checkerboard(side: int = 64, cell: int = 4) -> torch.Tensor:
    """(3, side, side) uint8 black and white squares."""
    idx = torch.arange(side) // cell
    board = ((idx[:, None] + idx[None, :]) % 2).to(torch.uint8) * 255
    return board.expand(3, side, side).clone()


def _blurred(image: torch.Tensor) -> torch.Tensor:
    """A 5x5 box blur of a (3, H, W) uint8 image, same size."""
    x = image.to(torch.float32)[None]
    x = F.avg_pool2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    return x[0].round().clamp(0, 255).to(torch.uint8)


def _shapes(seed: int, side: int = 64) -> torch.Tensor:
    """(3, side, side) uint8: a few coloured rectangles on a coloured ground."""
    g = torch.Generator().manual_seed(seed)
    image = torch.empty(3, side, side, dtype=torch.uint8)
    image[:] = torch.randint(0, 256, (3, 1, 1), generator=g, dtype=torch.uint8)
    for _ in range(4):
        y0, x0 = torch.randint(0, side - 8, (2,), generator=g).tolist()
        h, w = torch.randint(6, side // 2, (2,), generator=g).tolist()
        image[:, y0 : y0 + h, x0 : x0 + w] = torch.randint(0, 256, (3, 1, 1), generator=g, dtype=torch.uint8)
    return image


def _png_round_trip(image: torch.Tensor) -> torch.Tensor:
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    buf.seek(0)
    return torch.from_numpy(np.array(Image.open(buf).convert("RGB"))).permute(2, 0, 1)


def test_sharpness_of_a_flat_image_is_zero() -> None:
    flat = torch.full((1, 3, 32, 32), 137, dtype=torch.uint8)
    assert Sharpness().score(flat, ["p"]) == [0.0]


def test_sharpness_of_a_checkerboard_exceeds_its_blurred_copy() -> None:
    board = _checkerboard()
    sharp, soft = Sharpness().score(torch.stack([board, _blurred(board)]), ["a", "a"])
    assert sharp > 10 * soft > 0


def test_sharpness_is_batch_independent_and_deterministic() -> None:
    images = [_shapes(1), _checkerboard(), _blurred(_shapes(2))]
    alone = Sharpness().score(images[0][None], ["x"])[0]
    batch = Sharpness().score(torch.stack(images), ["x", "y", "z"])
    again = Sharpness().score(torch.stack(images), ["x", "y", "z"])
    assert batch[0] == alone
    assert batch == again
    assert len(set(batch)) == 3


def test_scores_survive_a_png_round_trip() -> None:
    images = torch.stack([_shapes(3), _blurred(_shapes(4))])
    read_back = torch.stack([_png_round_trip(image) for image in images])
    assert torch.equal(read_back, images)
    assert Sharpness().score(read_back, ["a", "b"]) == Sharpness().score(images, ["a", "b"])
    assert perceptual_hashes(read_back) == perceptual_hashes(images)


def test_sharpness_rejects_float_pixels_and_a_prompt_count_mismatch() -> None:
    with pytest.raises(ValueError, match=r"uint8 pixels, got \(1, 3, 8, 8\) torch.float32"):
        Sharpness().score(torch.zeros(1, 3, 8, 8), ["p"])
    with pytest.raises(ValueError, match="2 images and 1 prompts"):
        Sharpness().score(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["p"])


def test_phash_of_identical_images_is_equal_and_batch_independent() -> None:
    image = _shapes(5)
    alone = perceptual_hashes(image[None])[0]
    batch = perceptual_hashes(torch.stack([_shapes(6), image, image.clone()]))
    assert batch[1] == batch[2] == alone
    assert 0 <= alone < 2**64
    assert hamming(alone, batch[2]) == 0


def test_phash_of_a_brightened_resized_copy_is_within_the_threshold() -> None:
    image = _shapes(7, side=128)
    brighter = (image.to(torch.int16) + 12).clamp(0, 255).to(torch.uint8)
    small = F.interpolate(brighter[None].float(), size=(96, 96), mode="bilinear", antialias=True)
    back = F.interpolate(small, size=(128, 128), mode="bilinear")[0]
    copy = back.round().clamp(0, 255).to(torch.uint8)
    a, b = perceptual_hashes(torch.stack([image, copy]))
    assert hamming(a, b) <= NEAR_DUPLICATE_BITS


def test_phash_of_unrelated_random_images_is_far() -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (6, 3, 64, 64), generator=g, dtype=torch.uint8)
    hashes = perceptual_hashes(noise)
    distances = [hamming(a, b) for i, a in enumerate(hashes) for b in hashes[i + 1 :]]
    assert min(distances) > 3 * NEAR_DUPLICATE_BITS


def test_hamming_counts_differing_bits() -> None:
    assert hamming(0, 2**64 - 1) == 64
    assert hamming(0b1011, 0b0001) == 2


def test_scorer_registry_builds_sharpness_and_names_the_known_ones() -> None:
    built = scorer("sharpness")
    assert isinstance(built, Sharpness) and built.higher_is_better
    with pytest.raises(ValueError, match="unknown image scorer 'beauty'.*are clip, sharpness, tiny, vqa"):
        scorer("beauty")
