"""What a family's answers are made of (model.family's protocol returns these): a compile region,
the text-conditioning shape, the attention counters, the task names. A family module builds them, and the face
(model/family.py) names them, so they sit below both. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Size = tuple[int, int]  # (width, height) in pixels

# What a checkpoint does (`ModelFamily.task`): makes images from text alone, or edits source
# images by an instruction (a job with `input.image_column`).
TEXT_TO_IMAGE = "text-to-image"
EDIT = "edit"
TASKS = (TEXT_TO_IMAGE, EDIT)


@dataclass(frozen=True)
class CompileRegion:
    """Methods compiled on some objects of one pipeline component.

    part: the compile setting that turns the region on ("vae" or "dit": `CompileConfig.vae` /
      `.dit`, and `compile_kwargs(part, ...)`).
    component: the pipeline attribute that holds the objects ("vae", "transformer").
    methods: method name -> its dynamic dimensions by argument position (as
      `compile.compiled_method` takes them: {position: dims}, nested for tuples and dicts);
      empty: every dimension static.
    owners: component -> the (label prefix, object) pairs whose methods are compiled, in order;
      a compiled method's label is "<prefix>.<method>".
    """

    part: str
    component: str
    methods: Mapping[str, Mapping[int, Any]]
    owners: Callable[[Any], Sequence[tuple[str, Any]]]

    def targets(self, pipe: Any) -> list[tuple[str, Any, str, Mapping[int, Any]]]:
        """(label, object, method, dynamic dims) of every compiled method in `pipe`, in order."""
        return [
            (f"{prefix}.{method}", owner, method, dims)
            for prefix, owner in self.owners(getattr(pipe, self.component))
            for method, dims in self.methods.items()
        ]


@dataclass(frozen=True)
class TextConditioning:
    """The shape of the text the DiT is conditioned on: embeddings (B, L, width), L <= max_length."""

    width: int
    max_length: int


@runtime_checkable
class AttentionCounters(Protocol):
    """Counters of the DiT's attention calls (model.qwen_image.attention.AttentionStats)."""

    def to_dict(self) -> dict[str, int]: ...

    def since(self, before: dict[str, int]) -> dict[str, int]: ...
