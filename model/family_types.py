"""The face's types (model.family): what a family is made of, shared by model/family.py and the
family folders (model/diffusers_pipeline/), which cannot import model/family.py (it imports them).

Standard library only (model.memory is torch-free).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ditfleet.model.memory import MemoryPlan, ModelMemory, dit_activation_bytes, largest_batch, plan_memory

Size = tuple[int, int]  # (width, height) in pixels


# ---------------------------------------------------------------------------------------------
# What the face is made of


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
    """Counters of the DiT's attention calls (model.networks.attention.AttentionStats)."""

    def to_dict(self) -> dict[str, int]: ...

    def since(self, before: dict[str, int]) -> dict[str, int]: ...


@dataclass(frozen=True)
class MemoryFormula:
    """How much memory a model of the family needs, from its configs alone (model.memory)."""

    def from_dir(self, root: str | Path, name: str | None = None) -> ModelMemory:
        """The configs of a local model folder (transformer/, vae/, text_encoder/)."""
        return ModelMemory.from_dir(root, name=name)

    def from_configs(
        self, transformer: dict, vae: dict, text_encoder: dict | None, name: str = "", where: str = ""
    ) -> ModelMemory:
        """The same from config.json contents read elsewhere (an object store)."""
        return ModelMemory.from_configs(transformer, vae, text_encoder, name=name, where=where)

    def plan(self, model: ModelMemory, **kwargs: Any) -> MemoryPlan:
        """`model.memory.plan_memory`: one image size and batch, phase by phase."""
        return plan_memory(model, **kwargs)

    def largest_batch(self, model: ModelMemory, gpu_memory_gb: float, **kwargs: Any) -> int:
        """`model.memory.largest_batch`: the largest batch that fits; 0 when not even 1 does."""
        return largest_batch(model, gpu_memory_gb, **kwargs)

    def math_attention_extra(
        self, model: ModelMemory, height: int, width: int, text_len: int, element_bytes: int
    ) -> int:
        """Bytes per image that attention without a fused kernel (the masked math path) adds."""
        args = (model.transformer, 1, height, width, text_len, element_bytes)
        return dit_activation_bytes(*args, "math") - dit_activation_bytes(*args, "fused")
