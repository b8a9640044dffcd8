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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from ditfleet.model.diffusers_pipeline.family import DiffusersFamily
from ditfleet.model.diffusers_pipeline.index import is_native, read_index
from ditfleet.model.family_types import (  # the face's types, shared with the family folders
    AttentionCounters,
    CompileRegion,
    MemoryFormula,
    Size,
    TextConditioning,
)
from ditfleet.model.loading.folder import TINY_MODEL
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH_LIMIT

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
    loaded pipeline (its own `family`, or by the model id it was loaded as), or a family itself.

    The path "tiny" is the tiny model; a local folder whose model_index.json names a pipeline
    class without a native family runs through diffusers (model.diffusers_pipeline); every other
    path is Qwen-Image (a remote checkpoint's index is read where it is fetched, on the actor).
    """
    if isinstance(source, ModelFamily):
        return source
    if not isinstance(source, (str, os.PathLike)):
        family = getattr(source, "family", None)
        if isinstance(family, ModelFamily):
            return family
        model_id = getattr(source, "model_id", None)
        if model_id is None:
            raise TypeError(
                f"model_family takes a model path or a loaded pipeline, got {type(source).__name__}"
            )
        source = model_id
    if str(source) == TINY_MODEL:
        return TINY
    return folder_family(source) or DEFAULT_FAMILY


def folder_family(source: str | os.PathLike) -> ModelFamily | None:
    """The diffusers family of a local folder whose model_index.json names a pipeline class with
    no native family; None for anything else (a remote path, a native or index-less folder)."""
    path = str(source).removeprefix("file://")
    if "://" in path or not os.path.isdir(path):
        return None
    info = read_index(path)
    if info is None or is_native(info.class_name):
        return None
    return DiffusersFamily(info.class_name)
