"""The bench's independent judge of tiny-model scenes (ditfleet.testing.scene_judge): it reads every
attribute of the scenes' own renderings, scores about chance on noise, and says no shape on a blank."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model.tiny.scenes import (
    PALETTE,
    SIZE_FRACTION,
    TINY_BUCKETS,
    Scene,
    all_scenes,
    outline,
    render,
    render_batch,
    sample_batch,
    shape_geometry,
    split_scenes,
)
from ditfleet.testing.scene_judge import judge, read_scenes


@pytest.mark.parametrize("width,height", TINY_BUCKETS)
def test_every_held_out_scene_is_read_right_anywhere_in_its_cell(width, height):
    held_out = split_scenes()[1]
    jitter = torch.rand(len(held_out), 2, generator=torch.Generator().manual_seed(0)) * 2.0 - 1.0
    images = render_batch(held_out, width, height, jitter)
    stored = (images * 255.0).round() / 255.0  # as a PNG holds it
    assert judge(stored, [s.caption for s in held_out]) == dict.fromkeys(
        ("color", "background", "position", "shape", "size", "all_five"), 1.0
    )


def _paint(scene: Scene, mask: torch.Tensor) -> torch.Tensor:
    fg, bg = (torch.tensor(PALETTE[c]).view(3, 1, 1) for c in (scene.color, scene.background))
    return bg + (fg - bg) * mask.float()


def _rounded_square(r: float, corner: float, width: int, height: int, cx: float, cy: float) -> torch.Tensor:
    """A square of half-side r whose corners are quarter circles of radius `corner`."""
    y, x = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    dx, dy = ((x - cx).abs() - (r - corner)).clamp(min=0), ((y - cy).abs() - (r - corner)).clamp(min=0)
    return ((x - cx).abs() < r) & ((y - cy).abs() < r) & (dx * dx + dy * dy < corner * corner)


@pytest.mark.parametrize("scale", [0.9, 1.1])
def test_a_shape_a_little_under_or_over_its_size_is_read_as_its_kind_and_size(scale):
    """Generated shapes are seldom exactly the drawn size: the judge fits the radius, so a shape 10%
    off is still read as its kind and size, and a square with rounded corners as a square (the two
    drawn radii alone read such a square, a pixel narrower, as a circle)."""
    held_out = split_scenes()[1]
    images, captions = [], []
    for scene in held_out:
        cx, cy, r = shape_geometry(scene, 128, 128)
        images.append(_paint(scene, outline(scene.shape, scale * r, 128, 128, cx, cy)))
        captions.append(scene.caption)
        if scene.shape == "square":
            images.append(_paint(scene, _rounded_square(scale * r, 0.35 * r, 128, 128, cx, cy)))
            captions.append(scene.caption)
    stored = (torch.stack(images) * 255.0).round() / 255.0
    assert judge(stored, captions)["all_five"] == 1.0
    assert SIZE_FRACTION["small"] * 1.1 < SIZE_FRACTION["large"] * 0.9  # the sizes stay apart at 10%


def test_noise_scores_about_chance_and_a_wrong_caption_nothing():
    g = torch.Generator().manual_seed(1)
    _, captions = sample_batch(all_scenes(), 200, 64, 64, g)
    s = judge(torch.rand(200, 3, 64, 64, generator=g), captions)
    # Chance: 1/6 for the background, 1/5 for the shape's colour, 1/9 for position, 1/3 for kind, 1/2 for size.
    assert s["color"] < 0.3 and s["background"] < 0.3 and s["position"] < 0.2 and s["shape"] < 0.45, s
    assert s["size"] < 0.65 and s["all_five"] < 0.03, s
    image = render(Scene("circle", "red", "blue", "top left", "large"), 128, 128)
    wrong = "a small green triangle at the bottom right on a white background"
    assert judge(image[None], [wrong]) == dict.fromkeys(
        ("color", "background", "position", "shape", "size", "all_five"), 0.0
    )


def test_one_colour_is_a_background_without_a_shape():
    blank = torch.tensor([0.12, 0.25, 0.90]).view(3, 1, 1).expand(3, 64, 64)
    (verdict,) = read_scenes(blank[None])
    assert verdict.background == "blue" and verdict.shape is verdict.color is verdict.position is None
