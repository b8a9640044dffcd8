"""Prompt adherence of generated scene images, measured with plain image analysis (no learned judge).

For an image (3, H, W) in [0, 1]:
- background: per-channel median of a border strip, snapped to the nearest palette colour;
- shape mask: pixels whose colour is far from the measured (unsnapped) background colour;
- shape colour: per-channel median inside the mask, snapped to the nearest palette colour;
- position: the mask's centroid, mapped to a cell of the 3x3 grid;
- kind: how much of the mask's bounding box the mask fills (circle pi/4, square 1, triangle 1/2).

On the procedural ground truth every attribute is recovered exactly; on noise it scores about chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.tiny.scenes import COLORS, PALETTE, POSITIONS, parse_caption

# Euclidean RGB distance from the background above which a pixel counts as shape. Palette colours are
# at least ~0.7 apart, so 0.25 leaves room for VAE blur and colour drift on both sides.
MASK_THRESHOLD = 0.25
# Border strip width in pixels used to measure the background.
BORDER = 3
# Fewer mask pixels than this fraction of the image means "no shape found".
MIN_MASK_FRACTION = 0.002
# Fill-ratio boundaries between triangle (0.5), circle (0.785) and square (1.0).
TRIANGLE_MAX_FILL = 0.64
CIRCLE_MAX_FILL = 0.90

_PALETTE = torch.tensor([PALETTE[c] for c in COLORS])  # (K, 3)


@dataclass(frozen=True)
class Measurement:
    """What the analysis saw in one image; fields are None when no shape was found."""

    background: str
    color: str | None
    position: str | None
    kind: str | None
    fill_ratio: float | None


def nearest_color(rgb: torch.Tensor) -> str:
    """Palette name closest (Euclidean) to `rgb` (3,)."""
    d = ((_PALETTE - rgb.view(1, 3).float()) ** 2).sum(dim=1)
    return COLORS[int(d.argmin())]


def measure(image: torch.Tensor) -> Measurement:
    """Analyse one image (3, H, W), float in [0, 1]."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"measure: expected an image of shape (3, H, W), got {tuple(image.shape)}.")
    img = image.detach().float().cpu().clamp(0.0, 1.0)
    _, h, w = img.shape
    border = torch.ones(h, w, dtype=torch.bool)
    border[BORDER : h - BORDER, BORDER : w - BORDER] = False
    bg_rgb = img[:, border].median(dim=1).values  # (3,)
    background = nearest_color(bg_rgb)

    dist = (img - bg_rgb.view(3, 1, 1)).norm(dim=0)  # (H, W)
    mask = dist > MASK_THRESHOLD
    count = int(mask.sum())
    if count < MIN_MASK_FRACTION * h * w:
        return Measurement(background, None, None, None, None)

    color = nearest_color(img[:, mask].median(dim=1).values)
    ys, xs = torch.nonzero(mask, as_tuple=True)
    cy, cx = ys.float().mean() + 0.5, xs.float().mean() + 0.5
    row = min(2, int(cy / h * 3))
    col = min(2, int(cx / w * 3))
    box = (int(ys.max()) - int(ys.min()) + 1) * (int(xs.max()) - int(xs.min()) + 1)
    fill = count / box
    kind = "triangle" if fill < TRIANGLE_MAX_FILL else "circle" if fill < CIRCLE_MAX_FILL else "square"
    return Measurement(background, color, POSITIONS[row * 3 + col], kind, fill)


def score(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """Fraction of images whose measured attributes match their captions.

    images: (B, 3, H, W) in [0, 1]; captions: B strings in the scene template.
    Returns {"shape_color", "background", "position", "kind"}, each in [0, 1].
    """
    if images.ndim != 4 or images.shape[0] != len(captions):
        raise ValueError(
            f"score: got {tuple(images.shape)} images for {len(captions)} captions; expected (B, 3, H, W) with B = len(captions)."
        )
    hits = {"shape_color": 0, "background": 0, "position": 0, "kind": 0}
    for image, caption in zip(images, captions):
        want = parse_caption(caption)
        got = measure(image)
        hits["shape_color"] += got.color == want.color
        hits["background"] += got.background == want.background
        hits["position"] += got.position == want.position
        hits["kind"] += got.kind == want.shape
    n = max(1, len(captions))
    return {k: v / n for k, v in hits.items()}
