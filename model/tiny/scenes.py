"""Procedural scenes for the bundled tiny model: one shape on a plain background, with its caption.

A scene is a shape (circle / square / triangle) of one palette colour, small or large, in one cell
of a 3x3 grid, on a background of another palette colour. Images are drawn with torch on the fly
(anti-aliased signed-distance rasterisation), so the data set needs no files and is the same on
every machine for a given seed.

Captions follow one template, e.g. "a small red circle at the top left on a blue background";
`parse_caption` inverts it. A fixed set of 64 captions (chosen by a hash of the caption text) is
held out of training, so the adherence check measures generalisation, not memorisation.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass

import torch

# The resolution buckets the tiny model is trained for, as (width, height): its family's defaults.
from ditfleet.model.tiny.sizes import TINY_BUCKETS  # noqa: F401 - re-exported for the recipe and the tests

# Palette: far apart in RGB so that plain nearest-colour analysis tells them apart even after a
# lossy VAE round trip. Values in [0, 1].
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.10),
    "green": (0.10, 0.72, 0.20),
    "blue": (0.12, 0.25, 0.90),
    "yellow": (0.95, 0.85, 0.10),
    "white": (0.96, 0.96, 0.96),
    "black": (0.06, 0.06, 0.06),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
# Grid cells in row-major order: index = row * 3 + col.
POSITIONS: tuple[str, ...] = (
    "top left",
    "top",
    "top right",
    "left",
    "centre",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)


def position_at(x: float, y: float, width: int, height: int) -> str:
    """The grid cell (of `POSITIONS`) that the point (x, y) of a width x height image falls in."""
    return POSITIONS[min(2, int(y / height * 3)) * 3 + min(2, int(x / width * 3))]


# How each position reads in a caption ("at the top left", "on the left", "in the centre").
POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}
# Shape half-extent as a fraction of min(height, width): large shapes still fit inside one cell of
# the 96-pixel side of the 160x96 bucket, with room for jitter. Small ones are 19 pixels across
# there: smaller, and the VAE's 8x latent rounds a small square's or triangle's corners into a circle.
SIZE_FRACTION: dict[str, float] = {"small": 0.10, "large": 0.14}
HELD_OUT_COUNT = 64


@dataclass(frozen=True)
class Scene:
    """What one image shows. `color` is the shape's colour; `background` differs from it."""

    shape: str
    color: str
    background: str
    position: str
    size: str

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("color", self.color, COLORS),
            ("background", self.background, COLORS),
            ("position", self.position, POSITIONS),
            ("size", self.size, SIZES),
        ):
            if value not in allowed:
                raise ValueError(f"Scene.{field}={value!r} is not one of {list(allowed)}.")
        if self.color == self.background:
            raise ValueError(
                f"Scene: shape colour and background are both {self.color!r}; pick two different colours."
            )

    @property
    def caption(self) -> str:
        return f"a {self.size} {self.color} {self.shape} {POSITION_PHRASES[self.position]} on a {self.background} background"

    @property
    def cell(self) -> tuple[int, int]:
        """(row, col) of the grid cell, each in 0..2."""
        return divmod(POSITIONS.index(self.position), 3)


def all_scenes() -> list[Scene]:
    """Every distinct scene (= every distinct caption), in a fixed order."""
    return [
        Scene(shape, color, background, position, size)
        for size, color, shape, position, background in itertools.product(
            SIZES, COLORS, SHAPES, POSITIONS, COLORS
        )
        if color != background
    ]


def _caption_hash(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()


def split_scenes() -> tuple[list[Scene], list[Scene]]:
    """(train, held_out): the `HELD_OUT_COUNT` scenes whose caption hashes sort first are held out.

    The rule depends only on caption text, so it is stable across runs, machines and Python versions.
    """
    ranked = sorted(all_scenes(), key=lambda s: _caption_hash(s.caption))
    held = ranked[:HELD_OUT_COUNT]
    held_set = set(held)
    return [s for s in all_scenes() if s not in held_set], held


def held_out_captions() -> list[str]:
    """The 64 test captions, never seen in training, in a fixed order."""
    return [s.caption for s in split_scenes()[1]]


_CAPTION_RE = re.compile(
    r"^\s*an?\s+(?P<size>\w+)\s+(?P<color>\w+)\s+(?P<shape>\w+)\s+(?P<where>.+?)\s+on\s+an?\s+(?P<background>\w+)\s+background\s*\.?\s*$"
)
_PHRASE_TO_POSITION = {phrase: pos for pos, phrase in POSITION_PHRASES.items()}
_PHRASE_TO_POSITION.update(
    {phrase.replace("centre", "center"): pos for pos, phrase in POSITION_PHRASES.items()}
)


def parse_caption(caption: str) -> Scene:
    """Inverse of `Scene.caption` (case-insensitive; "center" accepted). Raises ValueError with the caption."""
    m = _CAPTION_RE.match(caption.lower())
    if m is None:
        raise ValueError(
            f"caption {caption!r} does not follow the template "
            "'a <small|large> <colour> <circle|square|triangle> <at the top left|...> on a <colour> background'."
        )
    where = " ".join(m["where"].split())
    if where not in _PHRASE_TO_POSITION:
        raise ValueError(
            f"caption {caption!r}: unknown position phrase {where!r}; expected one of {list(_PHRASE_TO_POSITION)}."
        )
    try:
        return Scene(m["shape"], m["color"], m["background"], _PHRASE_TO_POSITION[where], m["size"])
    except ValueError as e:
        raise ValueError(f"caption {caption!r}: {e}") from e


def shape_geometry(
    scene: Scene, width: int, height: int, jitter: tuple[float, float] = (0.0, 0.0)
) -> tuple[float, float, float]:
    """(cx, cy, r) in pixels: the shape's centre and half-extent.

    `jitter` in [-1, 1]^2 moves the centre within the cell by up to the free room around the shape
    (minus a 2-pixel margin), so the shape never leaves its cell nor touches the image border.
    """
    row, col = scene.cell
    r = SIZE_FRACTION[scene.size] * min(width, height)
    cell_w, cell_h = width / 3.0, height / 3.0
    room_x = max(0.0, cell_w / 2.0 - r - 2.0)
    room_y = max(0.0, cell_h / 2.0 - r - 2.0)
    cx = (col + 0.5) * cell_w + jitter[0] * room_x
    cy = (row + 0.5) * cell_h + jitter[1] * room_y
    return cx, cy, r


def _shape_distance(
    shape: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """Signed distance in pixels (negative inside), (B, H, W).

    shape: (B,) index into SHAPES; x, y: (H, W) pixel-centre coordinates; cx, cy, r: (B,) pixels.
    """
    dx = x[None] - cx[:, None, None]  # (B, H, W)
    dy = y[None] - cy[:, None, None]
    r = r[:, None, None]
    circle = torch.sqrt(dx * dx + dy * dy) - r
    square = torch.maximum(dx.abs(), dy.abs()) - r
    # Upward isosceles triangle with apex (cx, cy - r) and base from (cx - r, cy + r) to (cx + r, cy + r):
    # intersection of three half-planes; its bounding box is the same 2r x 2r square (fill ratio 1/2).
    # Side edges: outward unit normals (+-2, -1)/sqrt(5) of the lines through the apex and a base corner.
    inv = 1.0 / (5.0**0.5)
    triangle = torch.maximum(dy - r, torch.maximum((2.0 * dx - dy - r) * inv, (-2.0 * dx - dy - r) * inv))
    kind = shape[:, None, None]
    return torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))


def render_batch(
    scenes: list[Scene], width: int, height: int, jitters: torch.Tensor | None = None
) -> torch.Tensor:
    """Scenes as float32 images (B, 3, height, width) in [0, 1], anti-aliased over about one pixel.

    jitters: (B, 2) in [-1, 1] (see `shape_geometry`), or None for centred shapes.
    """
    if jitters is None:
        jitters = torch.zeros(len(scenes), 2)
    geometry = torch.tensor(
        [shape_geometry(s, width, height, (float(j[0]), float(j[1]))) for s, j in zip(scenes, jitters)],
        dtype=torch.float32,
    ).view(-1, 3)  # (B, 3): cx, cy, r
    ys = torch.arange(height, dtype=torch.float32) + 0.5
    xs = torch.arange(width, dtype=torch.float32) + 0.5
    y, x = torch.meshgrid(ys, xs, indexing="ij")  # (H, W)
    shape = torch.tensor([SHAPES.index(s.shape) for s in scenes])
    distance = _shape_distance(shape, x, y, geometry[:, 0], geometry[:, 1], geometry[:, 2])
    coverage = (0.5 - distance).clamp(0.0, 1.0).unsqueeze(1)  # (B, 1, H, W)
    fg = torch.tensor([PALETTE[s.color] for s in scenes]).view(-1, 3, 1, 1)
    bg = torch.tensor([PALETTE[s.background] for s in scenes]).view(-1, 3, 1, 1)
    return bg + (fg - bg) * coverage


def shape_mask(shape: str, size: str, width: int, height: int, cx: float, cy: float) -> torch.Tensor:
    """(height, width) bool: pixels at least half covered by a `shape` of `size` centred at (cx, cy),
    drawn by the same rasteriser as `render_batch` (the ideal a generated shape is compared with)."""
    if size not in SIZES:
        raise ValueError(f"shape_mask: size {size!r}; expected one of {SIZES}.")
    return outline(shape, SIZE_FRACTION[size] * min(width, height), width, height, cx, cy)


def outline(shape: str, r: float, width: int, height: int, cx: float, cy: float) -> torch.Tensor:
    """(height, width) bool: pixels at least half covered by a `shape` of half-extent `r` pixels
    centred at (cx, cy), by `render_batch`'s rasteriser, at any radius, not only the two sizes'."""
    if shape not in SHAPES:
        raise ValueError(f"outline: shape {shape!r}; expected one of {SHAPES}.")
    ys = torch.arange(height, dtype=torch.float32) + 0.5
    xs = torch.arange(width, dtype=torch.float32) + 0.5
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    distance = _shape_distance(
        torch.tensor([SHAPES.index(shape)]), x, y, torch.tensor([cx]), torch.tensor([cy]), torch.tensor([r])
    )
    return distance[0] < 0.0


def size_at(half_extent: float, width: int, height: int) -> str:
    """The size whose drawn half-extent (a `SIZE_FRACTION` of min(width, height)) is nearest to
    `half_extent` pixels: what a shape of that half-extent is called."""
    fraction = half_extent / min(width, height)
    return min(SIZES, key=lambda size: abs(SIZE_FRACTION[size] - fraction))


def render(scene: Scene, width: int, height: int, jitter: tuple[float, float] = (0.0, 0.0)) -> torch.Tensor:
    """One scene as a float32 image (3, height, width) in [0, 1]."""
    return render_batch([scene], width, height, torch.tensor([jitter], dtype=torch.float32))[0]


def sample_batch(
    scenes: list[Scene],
    batch_size: int,
    width: int,
    height: int,
    generator: torch.Generator,
    jitter: float = 1.0,
) -> tuple[torch.Tensor, list[str]]:
    """A random batch: images (B, 3, height, width) in [0, 1] and their captions.

    Scenes are drawn uniformly from `scenes` with a random jitter scaled by `jitter` (1: anywhere in
    the free room of the cell, 0: at the cell's centre); everything comes from `generator`, so a
    seeded generator gives the same batch on any machine.
    """
    idx = torch.randint(len(scenes), (batch_size,), generator=generator)
    jit = (torch.rand(batch_size, 2, generator=generator) * 2.0 - 1.0) * jitter
    chosen = [scenes[i] for i in idx.tolist()]
    images = render_batch(chosen, width, height, jit)
    return images, [s.caption for s in chosen]
