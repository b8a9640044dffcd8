"""Prompt adherence of generated scene images, measured with plain image analysis (no learned judge).

For an image (3, H, W) in [0, 1]:
- background: per-channel median of a border strip, snapped to the nearest palette colour;
- shape mask: pixels whose colour is far from the measured (unsnapped) background colour;
- shape colour: per-channel median inside the mask, snapped to the nearest palette colour;
- position: the mask's centroid, mapped to a cell of the 3x3 grid;
- kind: how much of the mask's bounding box the mask fills (circle pi/4, square 1, triangle 1/2);
- size: the mask's half-extent (half the longer side of its bounding box), named by the nearest
  drawn size (`scenes.size_at`);
- blobs and holes: the number of 8-connected components of the mask and of holes in it (a clean
  shape is exactly one component without holes);
- IoU: overlap of the mask with the ideal captioned shape (kind and size as the caption says, drawn
  by the scenes' own rasteriser) moved so that its centroid sits on the mask's centroid. It measures
  the outline alone: position has its own check.

`generate_held_out` makes the images a model is judged on: the 64 held-out captions, one fixed
seed each, through the model's pipeline.

On the procedural ground truth every attribute is recovered exactly (IoU about 0.95 or more: only
the anti-aliased rim differs); on noise it scores about chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditfleet.model.tiny.scenes import (
    COLORS,
    PALETTE,
    held_out_captions,
    parse_caption,
    position_at,
    shape_mask,
    size_at,
)

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
    """What the analysis saw in one image; fields are None when no shape was found (blobs is then 0)."""

    background: str
    color: str | None
    position: str | None
    kind: str | None
    fill_ratio: float | None
    size: str | None = None
    extent: float | None = None
    blobs: int = 0
    holes: int = 0
    centroid: tuple[float, float] | None = None  # (x, y) in pixels


def nearest_color(rgb: torch.Tensor) -> str:
    """Palette name closest (Euclidean) to `rgb` (3,)."""
    d = ((_PALETTE - rgb.view(1, 3).float()) ** 2).sum(dim=1)
    return COLORS[int(d.argmin())]


def count_components(mask: torch.Tensor, connectivity: int = 8) -> int:
    """Number of `connectivity`-connected (8 or 4) components of a (H, W) bool mask.

    Union-find over the mask's pixels, all of its edges at once: each pixel starts as its own root;
    each round, a root joined by an edge to a smaller root takes the smallest one as its parent,
    and every pixel then follows its parents up to its root, until every edge has one root at both
    ends. The roots left count the components; parents only ever point to smaller indices, so no
    cycle forms, and a long thin component takes a few rounds, not one per pixel of its length.
    """
    if mask.ndim != 2:
        raise ValueError(f"count_components: expected a (H, W) mask, got {tuple(mask.shape)}.")
    if connectivity not in (4, 8):
        raise ValueError(f"count_components: connectivity must be 4 or 8, got {connectivity}.")
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if ys.numel() == 0:
        return 0
    # Only the bounding box matters: labelling there is much cheaper than on the whole image.
    mask = mask[int(ys.min()) : int(ys.max()) + 1, int(xs.min()) : int(xs.max()) + 1]
    h, w = mask.shape
    index = torch.arange(h * w).view(h, w)
    # Each pair of neighbours once, as (pixel, its neighbour) views of the mask and of the indices:
    # right and down, and for 8 the two diagonals.
    pairs = [
        (mask[:, :-1], mask[:, 1:], index[:, :-1], index[:, 1:]),
        (mask[:-1], mask[1:], index[:-1], index[1:]),
    ]
    if connectivity == 8:
        pairs += [
            (mask[:-1, :-1], mask[1:, 1:], index[:-1, :-1], index[1:, 1:]),
            (mask[:-1, 1:], mask[1:, :-1], index[:-1, 1:], index[1:, :-1]),
        ]
    ends_a, ends_b = [], []
    for in_a, in_b, at_a, at_b in pairs:
        both = in_a & in_b
        ends_a.append(at_a[both])
        ends_b.append(at_b[both])
    a, b = torch.cat(ends_a), torch.cat(ends_b)
    parent = torch.arange(h * w)
    while True:
        root_a, root_b = parent[a], parent[b]
        apart = root_a != root_b
        if not bool(apart.any()):
            break
        root_a, root_b = root_a[apart], root_b[apart]
        parent.scatter_reduce_(0, torch.maximum(root_a, root_b), torch.minimum(root_a, root_b), "amin")
        while True:
            grand = parent[parent]
            if torch.equal(grand, parent):
                break
            parent = grand
    return int(torch.unique(parent[mask.reshape(-1)]).numel())


def count_holes(mask: torch.Tensor) -> int:
    """Number of holes of a (H, W) bool mask: 4-connected background regions not joined to the
    outside (4 for the background pairs with 8 for the shape, so a diagonal gap is no hole)."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    if ys.numel() == 0:
        return 0
    # Crop to the bounding box plus a one-pixel frame: the frame is one region, the outside.
    crop = F.pad(mask[int(ys.min()) : int(ys.max()) + 1, int(xs.min()) : int(xs.max()) + 1], (1, 1, 1, 1))
    return count_components(~crop, connectivity=4) - 1


def measure(image: torch.Tensor) -> Measurement:
    """Analyse one image (3, H, W), float in [0, 1]."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"measure: expected an image of shape (3, H, W), got {tuple(image.shape)}.")
    img = image.detach().float().cpu().clamp(0.0, 1.0)
    return _measure_with_mask(img)[0]


def _measure_with_mask(img: torch.Tensor) -> tuple[Measurement, torch.Tensor]:
    _, h, w = img.shape
    border = torch.ones(h, w, dtype=torch.bool)
    border[BORDER : h - BORDER, BORDER : w - BORDER] = False
    bg_rgb = img[:, border].median(dim=1).values  # (3,)
    background = nearest_color(bg_rgb)

    dist = (img - bg_rgb.view(3, 1, 1)).norm(dim=0)  # (H, W)
    mask = dist > MASK_THRESHOLD
    count = int(mask.sum())
    if count < MIN_MASK_FRACTION * h * w:
        return Measurement(background, None, None, None, None), mask

    color = nearest_color(img[:, mask].median(dim=1).values)
    ys, xs = torch.nonzero(mask, as_tuple=True)
    cy, cx = float(ys.float().mean()) + 0.5, float(xs.float().mean()) + 0.5
    box_h = int(ys.max()) - int(ys.min()) + 1
    box_w = int(xs.max()) - int(xs.min()) + 1
    fill = count / (box_h * box_w)
    kind = "triangle" if fill < TRIANGLE_MAX_FILL else "circle" if fill < CIRCLE_MAX_FILL else "square"
    half_extent = max(box_h, box_w) / 2.0  # pixels
    extent = half_extent / min(h, w)
    size = size_at(half_extent, w, h)
    measurement = Measurement(
        background,
        color,
        position_at(cx, cy, w, h),
        kind,
        fill,
        size,
        extent,
        count_components(mask),
        count_holes(mask),
        (cx, cy),
    )
    return measurement, mask


def ideal_iou(mask: torch.Tensor, centroid: tuple[float, float] | None, shape: str, size: str) -> float:
    """IoU of `mask` (H, W) with the ideal `shape` of `size` whose centroid is moved onto `centroid`."""
    if centroid is None:
        return 0.0
    h, w = mask.shape
    # The drawn centre is not the centroid for a triangle (it sits r/3 below): find the offset by
    # drawing the ideal once in the middle of the image.
    probe = shape_mask(shape, size, w, h, w / 2.0, h / 2.0)
    ys, xs = torch.nonzero(probe, as_tuple=True)
    off_x = float(xs.float().mean()) + 0.5 - w / 2.0
    off_y = float(ys.float().mean()) + 0.5 - h / 2.0
    ideal = shape_mask(shape, size, w, h, centroid[0] - off_x, centroid[1] - off_y)
    union = int((mask | ideal).sum())
    return int((mask & ideal).sum()) / union if union else 0.0


def score(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """How well images match their captions.

    images: (B, 3, H, W) in [0, 1]; captions: B strings in the scene template.
    Returns fractions of images whose measured attribute matches the caption: "shape_color",
    "background", "position", "kind", "size"; "one_blob", the fraction whose shape mask is one clean
    blob (exactly one connected component, without holes); and "iou", the mean IoU with the ideal captioned shape (0 when none is found).
    """
    if images.ndim != 4 or images.shape[0] != len(captions):
        raise ValueError(
            f"score: got {tuple(images.shape)} images for {len(captions)} captions; expected (B, 3, H, W) with B = len(captions)."
        )
    hits = {"shape_color": 0, "background": 0, "position": 0, "kind": 0, "size": 0, "one_blob": 0}
    iou = 0.0
    for image, caption in zip(images, captions):
        want = parse_caption(caption)
        got, mask = _measure_with_mask(image.detach().float().cpu().clamp(0.0, 1.0))
        hits["shape_color"] += got.color == want.color
        hits["background"] += got.background == want.background
        hits["position"] += got.position == want.position
        hits["kind"] += got.kind == want.shape
        hits["size"] += got.size == want.size
        hits["one_blob"] += got.blobs == 1 and got.holes == 0
        iou += ideal_iou(mask, got.centroid, want.shape, want.size)
    n = max(1, len(captions))
    return {**{k: v / n for k, v in hits.items()}, "iou": iou / n}


def generate_held_out(
    pipe,
    steps: int,
    true_cfg_scale: float,
    width: int = 128,
    height: int = 128,
    batch_size: int = 16,
    seed: int = 0,
    prompts: list[str] | None = None,
    sources: list | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """Images (64, 3, height, width) in [0, 1] for the held-out captions, seeds seed + index.

    prompts: other prompts instead (e.g. an edit model's instructions); sources: an edit model's
    source images, one list per prompt (`pipe.generate(..., sources=...)`)."""
    captions = held_out_captions() if prompts is None else prompts
    images = []
    for start in range(0, len(captions), batch_size):
        chunk = captions[start : start + batch_size]
        seeds = list(range(seed + start, seed + start + len(chunk)))
        edit = {} if sources is None else {"sources": sources[start : start + batch_size]}
        images.append(
            pipe.generate(
                prompt=chunk,
                height=height,
                width=width,
                steps=steps,
                true_cfg_scale=true_cfg_scale,
                seeds=seeds,
                **edit,
            )
        )
    return torch.cat(images), captions
