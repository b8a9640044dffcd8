"""The diffusers family: what the layers above model/ know about a checkpoint that runs through
diffusers' own pipeline class (model.family's face, for `_class_name`s with no native family).

Standard library only (the driver reads the default buckets and refuses what cannot run without
torch). The memory plan cannot come from configs here (every pipeline has its own networks): the
weights' bytes come from the safetensors headers (index.parameter_bytes) and the activations are
measured at warm-up on the actor (loader.py), which checks them before each batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ditfleet.model.diffusers_pipeline.index import (
    PipelineIndex,
    pipeline_max_sources,
    pipeline_task,
    read_index,
)
from ditfleet.model.family_types import CompileRegion, Size, SourceSizes, TextConditioning
from ditfleet.model.memory.disk import checkpoint_size
from ditfleet.model.qwen_image.family import MemoryFormula

# Sizes near one megapixel, multiples of 64 (every pipeline here packs latents of 8x or 16x
# downsampling into 2x2 patches): what FLUX, SD3.5, Z-Image and FLUX.2 are trained around.
DIFFUSERS_BUCKETS: tuple[Size, ...] = ((1024, 1024), (1344, 768), (768, 1344), (1152, 896), (896, 1152))

# A block list of a diffusers transformer: the ModuleList attributes its forward loops over
# (FLUX: transformer_blocks + single_transformer_blocks; SD3 and FLUX.2 likewise; Z-Image: layers
# + noise_refiner + context_refiner; Qwen-Image: transformer_blocks).
_BLOCK_LIST_NAMES = (
    "transformer_blocks",
    "single_transformer_blocks",
    "layers",
    "noise_refiner",
    "context_refiner",
    "blocks",
)


def _decoder_owners(vae: Any) -> list[tuple[str, Any]]:
    # `vae.decode` returns a tuple or a DecoderOutput; its `decoder` module returns the pixels as
    # one tensor, which compile.compiled_method can split and pad by batch (compile.vae_batch).
    decoder = getattr(vae, "decoder", None)
    return [("vae.decoder", decoder)] if decoder is not None else []


def _block_owners(transformer: Any) -> list[tuple[str, Any]]:
    # Regional compile: each block's forward, all blocks of a list sharing one code object, so
    # one graph per list and resolution bucket, not per block.
    out = []
    for list_name in _BLOCK_LIST_NAMES:
        blocks = getattr(transformer, list_name, None)
        if blocks is None or not hasattr(blocks, "__iter__"):
            continue
        out += [(f"{list_name}.{i}", block) for i, block in enumerate(blocks)]
    return out


# Static shapes: the pipeline runs every batch at the actor's batch size (loader.py pads the
# last one), and text is padded by the pipelines' tokenizers to a fixed length, so one graph per
# bucket is all a request ever needs.
DIFFUSERS_COMPILE_REGIONS: tuple[CompileRegion, ...] = (
    CompileRegion("vae", "vae", MappingProxyType({"forward": {}}), _decoder_owners),
    CompileRegion("dit", "transformer", MappingProxyType({"forward": {}}), _block_owners),
)


class NoConfigFormula(ValueError):
    """A family whose memory is not a formula of its configs (measured at warm-up instead)."""


@dataclass(frozen=True)
class MeasuredMemory(MemoryFormula):
    """No formula from configs: the driver plans no batch (`plans_from_configs` False) and an
    actor runs the job's batch size, checking the weights' bytes plus the activations measured
    at warm-up against its GPU before each batch (loader.py)."""

    plans_from_configs: bool = False

    def from_dir(self, root: str | Path, name: str | None = None) -> Any:
        raise NoConfigFormula(
            f"{name or root}: a diffusers pipeline's memory is measured at warm-up, not planned from configs"
        )

    def from_configs(self, *args: Any, **kwargs: Any) -> Any:
        raise NoConfigFormula(
            "a diffusers pipeline's memory is measured at warm-up, not planned from configs"
        )


class NoPublishedConfigs(ValueError):
    """The self-test and the benches' published widths are the native family's."""


class NoAttentionCounters:
    """diffusers' attention is not instrumented: the shard result's attention counts stay empty."""

    def to_dict(self) -> dict[str, int]:
        return {}

    def since(self, before: dict[str, int]) -> dict[str, int]:
        return {}


@dataclass(frozen=True)
class DiffusersFamily:
    """A checkpoint of diffusers pipeline `class_name` (its model_index.json `_class_name`)."""

    class_name: str
    default_buckets: tuple[Size, ...] = DIFFUSERS_BUCKETS
    runs_on_cpu: bool = False
    compile_regions: tuple[CompileRegion, ...] = DIFFUSERS_COMPILE_REGIONS
    memory: MemoryFormula = field(default_factory=MeasuredMemory)
    # What the family does not get (docs/performance.md): these are the native family's own code.
    features: Mapping[str, bool] = field(
        default_factory=lambda: MappingProxyType(
            {"modulation_cache": False, "step_cache": False, "fp8": False}
        )
    )

    # A checkpoint folder, never a bundled model; the scorers get nothing of the pipeline (the
    # native family's Qwen2.5-VL is what `vqa` reads: model.quality.table).
    bundled_dir: Path | None = None
    scorer_inputs: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return f"diffusers:{self.class_name}"

    @property
    def published_dir(self) -> Path:
        # None bundled: a folder that does not exist (a property must not raise: isinstance against
        # the runtime-checkable protocol reads it); published_config says why.
        return Path(__file__).parent / "published"

    def published_config(self, rel: str, num_layers: int | None = None) -> dict:
        raise NoPublishedConfigs(f"{self.name}: ditfleet bundles no published configs of diffusers pipelines")

    def text_conditioning(self, pipe: Any) -> TextConditioning:
        # The pipeline encodes its own prompts (no embeddings cross the actor's interface); the
        # width is the transformer's text input as its config names it, when it names one.
        config = getattr(pipe.transformer, "config", {})
        width = int(getattr(config, "joint_attention_dim", 0) or getattr(config, "cap_feat_dim", 0) or 0)
        return TextConditioning(width, 0)

    def attention_counters(self, pipe: Any) -> NoAttentionCounters:
        return NoAttentionCounters()

    def task(self, model_index: dict) -> str:
        """ "edit" when the pipeline's `__call__` takes an `image` (image-to-image,
        Kontext: the job's sources go there), else "text-to-image" (index.pipeline_task)."""
        name = model_index.get("_class_name") if isinstance(model_index, dict) else None
        return pipeline_task(name if isinstance(name, str) and name else self.class_name)

    def max_sources(self, model_index: dict) -> int | None:
        """What one prompt's `image` takes in the pipeline's `__call__` (index.pipeline_max_sources):
        1 for a single image (SD3 img2img, FLUX Kontext), None for a list of references (FLUX.2)."""
        name = model_index.get("_class_name") if isinstance(model_index, dict) else None
        return pipeline_max_sources(name if isinstance(name, str) and name else self.class_name)

    def forward_flops(
        self, transformer_config: dict, width: int, height: int, text_tokens: int, sources: SourceSizes = ()
    ) -> float:
        # No formula per pipeline class here: "% of peak" is not stated for this family (0: unknown).
        return 0.0

    def load_pipeline(self, path: str | Path, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint through its own diffusers class (pipeline.load_diffusers_pipeline's
        arguments); imported here: it needs torch, which this module does not."""
        from ditfleet.model.diffusers_pipeline.loader import load_diffusers_pipeline

        return load_diffusers_pipeline(path, *args, **kwargs)


def parameter_bytes(root: str | Path, info: PipelineIndex | None = None) -> dict[str, int]:
    """Bytes of each component's weights as stored (safetensors headers only), by component."""
    root = Path(root)
    info = info or read_index(root)
    names = info.components if info is not None else {}
    out: dict[str, int] = {}
    for name in names:
        folder = root / name
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            out[name] = checkpoint_size(folder).bytes
    return out
