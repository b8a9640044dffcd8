"""An independent judge of the bundled tiny model's scene images, by analysis by synthesis.

The quality gate's `tiny` scorer reads a scene's five attributes with the adherence analysis of
model/tiny/adherence.py (border-median background, a colour-distance mask, the mask's bounding-box
fill ratio for the kind, its half-extent for the size, its centroid for the position). A bench that
judged the gate with that same analysis would let the gate grade its own work, so this judge
decides the same attributes by another method:

- colours: every pixel votes for its nearest palette colour; the most voted colour is the
  background, the runner-up the shape's (a palette histogram: stray artefact pixels of a third
  colour do not mix into either, as they would into a two-cluster mean).
- kind, size and position, together: each kind drawn by the scenes' own rasteriser (`outline`), at
  every half-extent from well under the small size's to well over the large size's in half-pixel
  steps, is laid over the image at every pixel, in the mean colours of the two colours' voters (so
  a uniform colour drift biases no candidate); the rendering with the least squared pixel error
  wins. Its kind is the shape's; its half-extent, named by the nearest drawn size
  (`scenes.size_at`), the size. Position is the grid cell of its drawn centre, the point
  `shape_geometry` keeps inside its cell. The radius is fitted, not fixed at the two drawn sizes,
  so a shape a little under or over its size is still compared with its own kind at its own size:
  with only the two drawn radii, a square a pixel narrower than drawn and with rounded corners fits
  the circle of the drawn radius better than the square, though anyone would call it a square.

The least-squares fit needs no loop over placements. With background colour b and shape colour f,
an ideal rendering is b + (f - b) * c for a 0/1 shape c, and its squared error against image I is,
up to terms no candidate changes, |f - b|^2 * (|c|^2 - 2 <e, c>), where e = <I - b, f - b> / |f - b|^2
is how far each pixel lies from the background towards the shape colour. So one cross-correlation
of e with every candidate shape scores every placement of every candidate at once.

On the procedural ground truth every attribute is recovered; on noise it scores about chance.
Used by bench/quality_gate.py; nothing here is used by a job.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditfleet.model.tiny.scenes import (
    COLORS,
    PALETTE,
    SHAPES,
    SIZE_FRACTION,
    outline,
    parse_caption,
    position_at,
    size_at,
)

#: The attributes a caption states, named as `Scene`'s fields.
ATTRIBUTES = ("color", "background", "position", "shape", "size")
_PALETTE = torch.tensor([PALETTE[c] for c in COLORS])  # (K, 3)
# The fitted half-extents span this much below the small size's and above the large size's.
RADIUS_MARGIN = 0.3


@dataclass(frozen=True)
class Verdict:
    """The scene the judge reads in one image; the shape's fields are None when it saw one colour."""

    background: str
    color: str | None
    position: str | None
    shape: str | None
    size: str | None


def palette_colours(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pixel of images (B, 3, H, W) votes for its nearest palette colour: (background index (B,),
    shape colour index (B,), the mean colour of each one's voters (B, 3) twice), the background the
    most voted, the shape's colour the runner-up (the background again if no pixel voted for another)."""
    pixels = images.flatten(2).transpose(1, 2)  # (B, N, 3)
    palette = _PALETTE.expand(len(pixels), -1, -1)  # (B, K, 3)
    distance = (palette * palette).sum(dim=2).unsqueeze(1) - 2.0 * pixels @ palette.transpose(1, 2)
    members = F.one_hot(distance.argmin(dim=2), len(COLORS)).float()  # (B, N, K); |p|^2 left out above
    votes = members.sum(dim=1)  # (B, K)
    means = members.transpose(1, 2) @ pixels / votes.clamp(min=1.0).unsqueeze(2)
    means = torch.where(votes.unsqueeze(2) > 0, means, palette)
    bg = votes.argmax(dim=1)
    fg = votes.scatter(1, bg.unsqueeze(1), -1.0).argmax(dim=1)
    rows = torch.arange(len(pixels))
    fg = torch.where(votes[rows, fg] > 0, fg, bg)  # one colour only: no shape colour, fg = bg
    return bg, fg, means[rows, bg], means[rows, fg]


@functools.cache
def _candidates(width: int, height: int) -> tuple[tuple[tuple[str, float], ...], torch.Tensor]:
    """Every candidate (kind, half-extent in pixels), and each drawn centred in a k x k window:
    (C, k, k) float, k odd.

    Each is cut from a full-size `outline` drawn at the image's centre, the window's centre pixel
    on that centre's pixel.
    """
    side = min(width, height)
    low = (1.0 - RADIUS_MARGIN) * SIZE_FRACTION["small"] * side
    high = (1.0 + RADIUS_MARGIN) * SIZE_FRACTION["large"] * side
    radii = [low + 0.5 * i for i in range(int((high - low) / 0.5) + 1)]
    candidates = tuple(itertools.product(SHAPES, radii))
    k = 2 * math.ceil(high) + 3
    x0, y0 = width // 2 - k // 2, height // 2 - k // 2
    drawn = [outline(kind, r, width, height, width / 2.0, height / 2.0) for kind, r in candidates]
    return candidates, torch.stack([m[y0 : y0 + k, x0 : x0 + k] for m in drawn]).float()


def correlate(evidence: torch.Tensor, templates: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W): each template (C, k, k), k odd, summed against evidence (B, H, W) with its
    centre on each pixel, zeros outside the image (conv2d with padding k // 2), through the FFT:
    a direct 2-D convolution with a window this large is far slower on a CPU."""
    _, height, width = evidence.shape
    k = templates.shape[-1]
    size = (height + k - 1, width + k - 1)  # room for the window on every pixel: nothing wraps around
    padded = F.pad(evidence, (k // 2, k // 2, k // 2, k // 2))
    spectrum = torch.fft.rfft2(padded, s=size).unsqueeze(1) * torch.fft.rfft2(templates, s=size).conj()
    return torch.fft.irfft2(spectrum, s=size)[..., :height, :width]


def fit_shapes(evidence: torch.Tensor) -> list[tuple[str, str, str]]:
    """(kind, size, position) of the best-fitting candidate rendering, for each evidence map of (B, H, W)."""
    _, height, width = evidence.shape
    candidates, templates = _candidates(width, height)
    # Squared error up to a constant, negated: higher fits better.
    fit = 2.0 * correlate(evidence, templates) - templates.sum(dim=(1, 2)).view(1, -1, 1, 1)
    fits = []
    for best in fit.flatten(1).argmax(dim=1).tolist():
        candidate, row, col = best // (height * width), (best // width) % height, best % width
        # (row, col) is the pixel under the window's centre pixel: the drawn centre, but for the half
        # pixel an even side puts between it and that pixel's centre.
        cx, cy = col + width / 2.0 - width // 2, row + height / 2.0 - height // 2
        kind, r = candidates[candidate]
        fits.append((kind, size_at(r, width, height), position_at(cx, cy, width, height)))
    return fits


def read_scenes(images: torch.Tensor) -> list[Verdict]:
    """The judge's reading of each image of (B, 3, H, W), float in [0, 1]."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"read_scenes: expected images of shape (B, 3, H, W), got {tuple(images.shape)}.")
    img = images.detach().float().cpu().clamp(0.0, 1.0)
    bg, fg, bg_rgb, fg_rgb = palette_colours(img)
    axis = fg_rgb - bg_rgb  # (B, 3); two palette colours' voters, so far apart unless fg = bg
    scale = (axis * axis).sum(dim=1, keepdim=True).clamp(min=1e-6)
    evidence = torch.einsum("bchw,bc->bhw", img - bg_rgb[:, :, None, None], axis / scale)
    verdicts = []
    for b, f, (kind, size, position) in zip(bg.tolist(), fg.tolist(), fit_shapes(evidence)):
        if b == f:  # one colour only: no shape
            verdicts.append(Verdict(COLORS[b], None, None, None, None))
        else:
            verdicts.append(Verdict(COLORS[b], COLORS[f], position, kind, size))
    return verdicts


def judge(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
    """Share of images (B, 3, H, W) in [0, 1] whose read attribute matches its caption, for each of
    `ATTRIBUTES`, and "all_five": the share with every attribute right."""
    if images.ndim != 4 or images.shape[0] != len(captions):
        raise ValueError(
            f"judge: got {tuple(images.shape)} images for {len(captions)} captions; expected (B, 3, H, W) with B = len(captions)."
        )
    hits = dict.fromkeys((*ATTRIBUTES, "all_five"), 0)
    for caption, got in zip(captions, read_scenes(images)):
        want = parse_caption(caption)
        right = [getattr(want, a) == getattr(got, a) for a in ATTRIBUTES]
        for a, ok in zip(ATTRIBUTES, right):
            hits[a] += ok
        hits["all_five"] += all(right)
    n = max(1, len(captions))
    return {a: v / n for a, v in hits.items()}
