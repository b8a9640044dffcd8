"""Edits of the tiny model's scenes: (source scene, instruction, target scene), for its edit variant.

An instruction changes exactly one attribute of a scene and the target keeps every other one:

    make the shape blue                 the shape's colour
    make the background yellow          the background's colour
    make the shape a triangle           the kind
    make the shape large                the size
    move the shape to the top left      the position (the same place within its new cell)

`parse_instruction` inverts `Edit.instruction`; `apply_edit` gives the target scene, refusing an
edit that changes nothing or paints the shape the background's colour (the scenes' own rule).
The held-out edits are the scenes' 64 held-out scenes as sources (never seen by the text model nor
by the edit fine-tune), each with one instruction picked by a hash of its caption, so the
adherence check (`model.tiny.edit_adherence`) measures instructions on unseen pictures.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

import torch

from ditfleet.model.tiny.scenes import (
    COLORS,
    POSITIONS,
    SHAPES,
    SIZES,
    Scene,
    render_batch,
    shape_geometry,
    split_scenes,
)

# The attribute an instruction changes, in `Scene`'s field names, in a fixed order.
ATTRIBUTES: tuple[str, ...] = ("color", "background", "shape", "size", "position")
# The words instructions add to the captions' vocabulary (the edit model's tokenizer has them).
INSTRUCTION_WORDS: tuple[str, ...] = ("make", "move", "shape", "to")


@dataclass(frozen=True)
class Edit:
    """Set `attribute` (one of `ATTRIBUTES`) of a scene to `value`."""

    attribute: str
    value: str

    def __post_init__(self) -> None:
        allowed = _VALUES.get(self.attribute)
        if allowed is None:
            raise ValueError(f"Edit.attribute={self.attribute!r} is not one of {list(ATTRIBUTES)}.")
        if self.value not in allowed:
            raise ValueError(f"Edit: {self.attribute} {self.value!r} is not one of {list(allowed)}.")

    @property
    def instruction(self) -> str:
        if self.attribute == "background":
            return f"make the background {self.value}"
        if self.attribute == "shape":
            return f"make the shape a {self.value}"
        if self.attribute == "position":
            return f"move the shape to the {self.value}"
        return f"make the shape {self.value}"  # a colour or a size: their words differ


_VALUES: dict[str, tuple[str, ...]] = {
    "color": COLORS,
    "background": COLORS,
    "shape": SHAPES,
    "size": SIZES,
    "position": POSITIONS,
}
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:(?P<make>make)\s+the\s+(?P<what>shape|background)\s+(?:an?\s+)?(?P<value>\w+)"
    r"|move\s+the\s+shape\s+to\s+the\s+(?P<where>.+?))\s*\.?\s*$"
)


def parse_instruction(text: str) -> Edit:
    """Inverse of `Edit.instruction` (case-insensitive; "center" accepted). Raises ValueError
    naming the instruction and the forms it may take."""
    m = _INSTRUCTION_RE.match(text.lower())
    forms = (
        "'make the shape <colour|small|large>', 'make the shape a <circle|square|triangle>', "
        "'make the background <colour>' or 'move the shape to the <top left|top|...|centre|...>'"
    )
    if m is None:
        raise ValueError(f"instruction {text!r} is not one of the tiny edit model's forms: {forms}.")
    if m["make"] is None:
        where = " ".join(m["where"].split()).replace("center", "centre")
        if where not in POSITIONS:
            raise ValueError(
                f"instruction {text!r}: unknown position {where!r}; expected one of {list(POSITIONS)}."
            )
        return Edit("position", where)
    value = m["value"]
    named = (
        ["background"]
        if m["what"] == "background"
        else [a for a in ("color", "shape", "size") if value in _VALUES[a]]
    )
    if not named:
        raise ValueError(
            f"instruction {text!r}: {value!r} is no colour, kind or size; the forms are {forms}."
        )
    try:
        return Edit(named[0], value)
    except ValueError as e:
        raise ValueError(f"instruction {text!r}: {e}") from None


def apply_edit(scene: Scene, edit: Edit) -> Scene:
    """The target scene: `scene` with `edit.attribute` set to `edit.value`. ValueError when the edit
    changes nothing or leaves the shape the background's colour."""
    if getattr(scene, edit.attribute) == edit.value:
        raise ValueError(f"edit {edit.instruction!r} changes nothing in {scene.caption!r}.")
    return replace(scene, **{edit.attribute: edit.value})  # Scene checks colour != background


def edits_of(scene: Scene) -> list[Edit]:
    """Every edit that applies to `scene`, in a fixed order (attribute, then value)."""
    edits = []
    for attribute in ATTRIBUTES:
        for value in _VALUES[attribute]:
            edit = Edit(attribute, value)
            try:
                apply_edit(scene, edit)
            except ValueError:
                continue
            edits.append(edit)
    return edits


def sample_edits(scenes: list[Scene], n: int, generator: torch.Generator) -> list[tuple[Scene, Edit]]:
    """`n` random (source, edit) pairs: a source drawn uniformly from `scenes`, an attribute
    uniformly (so a move, with eight targets, is no likelier than a resize, with one), then one of
    its values that applies. Everything comes from `generator`."""
    pairs = []
    sources = torch.randint(len(scenes), (n,), generator=generator).tolist()
    draws = torch.rand(n, 2, generator=generator).tolist()
    for index, (a, v) in zip(sources, draws):
        scene = scenes[index]
        options = edits_of(scene)
        attributes = sorted({e.attribute for e in options}, key=ATTRIBUTES.index)
        attribute = attributes[min(int(a * len(attributes)), len(attributes) - 1)]
        values = [e for e in options if e.attribute == attribute]
        pairs.append((scene, values[min(int(v * len(values)), len(values) - 1)]))
    return pairs


def held_out_edits() -> list[tuple[Scene, Edit]]:
    """The 64 test edits: each held-out scene with the edit its caption's hash picks, the
    attributes taking turns so each is tested about equally often."""
    pairs = []
    for i, scene in enumerate(split_scenes()[1]):
        attribute = ATTRIBUTES[i % len(ATTRIBUTES)]
        options = [e for e in edits_of(scene) if e.attribute == attribute]
        digest = int(hashlib.sha256(scene.caption.encode("utf-8")).hexdigest(), 16)
        pairs.append((scene, options[digest % len(options)]))
    return pairs


def target_jitter(
    source: Scene, target: Scene, jitter: tuple[float, float], width: int, height: int
) -> tuple[float, float]:
    """The target's jitter (`scenes.shape_geometry`) for a source drawn with `jitter`: the shape
    stays where it was within its cell (a resize keeps its centre, as far as the cell allows), so
    the target differs from the source in what the instruction named alone."""
    if source.size == target.size:
        return jitter
    sx, sy, _ = shape_geometry(source, width, height, jitter)
    cx, cy, _ = shape_geometry(target, width, height)  # the cell's centre
    ux, uy, _ = shape_geometry(target, width, height, (1.0, 1.0))
    room = (ux - cx, uy - cy)
    return tuple(  # type: ignore[return-value]
        max(-1.0, min(1.0, (s - c) / r)) if r > 0 else 0.0 for s, c, r in zip((sx, sy), (cx, cy), room)
    )


def render_pairs(
    pairs: list[tuple[Scene, Edit]], width: int, height: int, jitters: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources, targets), each (B, 3, height, width) float32 in [0, 1]: every pair's source scene
    drawn with its jitter (B, 2) (None: centred), and its edited scene beside it."""
    if jitters is None:
        jitters = torch.zeros(len(pairs), 2)
    sources = [scene for scene, _ in pairs]
    targets = [apply_edit(scene, edit) for scene, edit in pairs]
    moved = torch.tensor(
        [
            target_jitter(s, t, (float(j[0]), float(j[1])), width, height)
            for s, t, j in zip(sources, targets, jitters)
        ],
        dtype=torch.float32,
    ).view(-1, 2)
    return render_batch(sources, width, height, jitters), render_batch(targets, width, height, moved)
