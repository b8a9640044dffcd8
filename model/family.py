"""The model's face: what the layers above model/ may know about a model family, in one place.

    family = model_family(spec_model_path)   # or a loaded pipeline, or a family
    family.default_buckets                   # ((1328, 1328), (1664, 928), ...): (width, height)
    family.runs_on_cpu                       # an actor needs no GPU unless the job says so
    family.compile_regions                   # what torch.compile wraps, with its dynamic dims
    family.text_conditioning(pipe)           # (embedding width, longest prompt in tokens)
    family.attention_counters(pipe)          # counters of the DiT's attention calls
    family.memory                            # the memory formula (model.memory) from configs

compile/, workers/, driver/ and jobs/ ask the family and never name a submodule, method or
constant of the Qwen-Image DiT themselves (tests/unit/test_model_face.py parses them): a second
family is a second `ModelFamily` here, not edits across the layers. Qwen-Image is the one family;
the bundled tiny model is a configuration of it (same architecture, own sizes, runs on the CPU).

Standard library only (model.memory and the config readers are torch-free):
the job spec and the driver's planning read the defaults without loading torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from ditfleet.model.loading.folder import TINY_MODEL
from ditfleet.model.memory import MemoryPlan, ModelMemory, dit_activation_bytes, largest_batch, plan_memory
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH_LIMIT

Size = tuple[int, int]  # (width, height) in pixels

# Qwen-Image's recommended sizes per aspect ratio. Its 4:3 and 3:4 sizes are 1472x1140 and
# 1140x1472; 1140 is not a multiple of 16, so they are replaced by the nearest multiple, 1136
# (which is also what the reference pipeline generates when asked for 1140: it rounds down to 16).
# The first bucket is the default for rows that give no size.
QWEN_IMAGE_BUCKETS: tuple[Size, ...] = (
    (1328, 1328),  # 1:1
    (1664, 928),  # 16:9
    (928, 1664),  # 9:16
    (1472, 1136),  # 4:3 (recommended 1472x1140)
    (1136, 1472),  # 3:4 (recommended 1140x1472)
    (1584, 1056),  # 3:2
    (1056, 1584),  # 2:3
)

# For the bundled tiny model: square, landscape 5:3 and portrait 3:5. Latent grids 16x16, 12x20
# and 20x12 are even, as packing needs; small enough for CPU tests.
TINY_BUCKETS: tuple[Size, ...] = ((128, 128), (160, 96), (96, 160))


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
    """Counters of the DiT's attention calls (model.qwen_image.attention.AttentionStats)."""

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


@runtime_checkable
class ModelFamily(Protocol):
    """What the layers above model/ know about a model family; see the module docstring.

    The data members are read-only properties: a family is frozen, and a frozen dataclass's
    fields satisfy a read-only member, not a settable one."""

    @property
    def name(self) -> str: ...

    @property
    def default_buckets(self) -> tuple[Size, ...]: ...  # (width, height); the first is the default size

    @property
    def runs_on_cpu(self) -> bool: ...  # actors get no GPU unless the job asks for one

    @property
    def compile_regions(self) -> tuple[CompileRegion, ...]: ...

    @property
    def memory(self) -> MemoryFormula: ...

    def text_conditioning(self, pipe: Any) -> TextConditioning: ...

    def attention_counters(self, pipe: Any) -> AttentionCounters: ...


# ---------------------------------------------------------------------------------------------
# Qwen-Image


def _vae_owners(vae: Any) -> list[tuple[str, Any]]:
    # The pipeline calls `vae.decode`, so decode is what is compiled (compiling the module would
    # compile `forward`, which decoding never calls).
    return [("vae", vae)]


def _block_owners(transformer: Any) -> list[tuple[str, Any]]:
    return [(f"transformer_blocks.{block.index}", block) for block in transformer.transformer_blocks]


# The DiT block's two tensor functions around its attention kernel (attention_inputs: norm,
# modulate, q/k/v, RMS norm, RoPE; attention_outputs: projections, gated residuals, MLPs), with
# their dynamic dims by argument position: batch (dim 0) everywhere, text length on the text
# tensors and the text RoPE table. The image token count stays static (one graph per resolution
# bucket, specialised to it). The block's forward (the modulation cache lookup) and the attention
# kernel (unmasked, or split by text length, decided per batch) stay eager. All blocks share one
# code object, so it is one graph per bucket, not per block.
_DIT_BLOCK_METHODS: Mapping[str, Mapping[int, Any]] = MappingProxyType(
    {
        # attention_inputs(img, txt, img_mod, txt_mod, rope=(image Rotation, text Rotation))
        "attention_inputs": {0: (0,), 1: (0, 1), 4: {1: {"cos": (0,), "sin": (0,), "polar": (0,)}}},
        # attention_outputs(img, txt, img_attn, txt_attn, img_mod, txt_mod)
        "attention_outputs": {0: (0,), 1: (0, 1), 2: (0,), 3: (0, 1)},
    }
)

QWEN_IMAGE_COMPILE_REGIONS: tuple[CompileRegion, ...] = (
    CompileRegion("vae", "vae", MappingProxyType({"decode": {}}), _vae_owners),
    CompileRegion("dit", "transformer", _DIT_BLOCK_METHODS, _block_owners),
)


@dataclass(frozen=True)
class QwenImageFamily:
    """Qwen-Image (model.transformer, model.vae, ...); the tiny model is `TINY`, a configuration."""

    name: str = "qwen-image"
    default_buckets: tuple[Size, ...] = QWEN_IMAGE_BUCKETS
    runs_on_cpu: bool = False
    compile_regions: tuple[CompileRegion, ...] = QWEN_IMAGE_COMPILE_REGIONS
    memory: MemoryFormula = field(default_factory=MemoryFormula)
    # The longest prompt the text path embeds, in tokens (what a job may ask for at most).
    max_text_tokens: int = MAX_SEQUENCE_LENGTH_LIMIT

    def text_conditioning(self, pipe: Any) -> TextConditioning:
        return TextConditioning(pipe.transformer.config.joint_attention_dim, self.max_text_tokens)

    def attention_counters(self, pipe: Any) -> AttentionCounters:
        return pipe.transformer.attention_stats


QWEN_IMAGE = QwenImageFamily()
TINY = replace(QWEN_IMAGE, name="tiny", default_buckets=TINY_BUCKETS, runs_on_cpu=True)
# The family of every model path but "tiny", and of configs built without naming a model.
DEFAULT_FAMILY: ModelFamily = QWEN_IMAGE


def model_family(source: Any) -> ModelFamily:
    """The family of a model path as a job names it ("tiny", a folder, s3://..., hf://...), of a
    loaded pipeline (by the model id it was loaded as), or a family itself.

    Only the path "tiny" is the tiny model; every other path is Qwen-Image (the one family here:
    the transformer's config refuses any other when it is read).
    """
    if isinstance(source, ModelFamily):
        return source
    if not isinstance(source, (str, os.PathLike)):
        model_id = getattr(source, "model_id", None)
        if model_id is None:
            raise TypeError(
                f"model_family takes a model path or a loaded pipeline, got {type(source).__name__}"
            )
        source = model_id
    return TINY if str(source) == TINY_MODEL else DEFAULT_FAMILY
