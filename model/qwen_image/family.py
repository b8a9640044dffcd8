"""The Qwen-Image family as the face (model/family.py) sees it: its buckets, compile regions,
memory formula, forward cost and how a checkpoint of it loads. The bundled tiny model is `TINY`,
a configuration of it (same architecture, own sizes, runs on the CPU).

Standard library only (the loader, which needs torch, is imported when a pipeline is loaded):
the job spec and the driver's planning read the defaults without loading torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ditfleet.model.family_types import AttentionCounters, CompileRegion, Size, TextConditioning
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.model.memory import MemoryPlan, ModelMemory, dit_activation_bytes, largest_batch, plan_memory
from ditfleet.model.quality.table import PIPELINE_QWEN_VL
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH_LIMIT
from ditfleet.model.tiny.sizes import TINY_BUCKETS

if TYPE_CHECKING:
    from ditfleet.model.generation.pipeline import TextToImagePipeline

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
# The model_index.json `_class_name` of its checkpoints (model.family's table maps it here).
QWEN_IMAGE_PIPELINE_CLASS = "QwenImagePipeline"
# Pixels per latent token side: the VAE's 8x downsampling times the DiT's 2x2 patches.
PIXELS_PER_TOKEN = 16


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


def forward_flops(
    config: TransformerConfig, img_tokens: int, txt_tokens: int, batch: int = 1
) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one DiT forward, from its config: "total", and the share of
    it that is "modulation" (img_mod + txt_mod of one timestep row, what the modulation cache saves).

    Per block: the linears of both streams (q, k, v, out and the 4x MLP) over all T tokens,
    attention (QK^T and AV over T x T), the modulation; plus the input embeddings."""
    D, T = config.inner_dim, img_tokens + txt_tokens
    linear = 2 * T * (4 * D * D + 2 * 4 * D * D)
    attention = 2 * 2 * T * T * D
    modulation = 2 * 2 * D * 6 * D
    embed = 2 * (img_tokens * config.in_channels * D + txt_tokens * config.joint_attention_dim * D)
    total = config.num_layers * (linear + attention + modulation) + embed
    return {"total": float(batch * total), "modulation": float(batch * config.num_layers * modulation)}


@dataclass(frozen=True)
class QwenImageFamily:
    """Qwen-Image (model.qwen_image); the tiny model is `TINY`, a configuration of it."""

    name: str = "qwen-image"
    default_buckets: tuple[Size, ...] = QWEN_IMAGE_BUCKETS
    runs_on_cpu: bool = False
    compile_regions: tuple[CompileRegion, ...] = QWEN_IMAGE_COMPILE_REGIONS
    memory: MemoryFormula = field(default_factory=MemoryFormula)
    # The longest prompt the text path embeds, in tokens (what a job may ask for at most).
    max_text_tokens: int = MAX_SEQUENCE_LENGTH_LIMIT
    bundled_dir: Path | None = None
    # The published checkpoint's config files (published/): the family's model at its published
    # widths, which the node self-test builds with random weights.
    published_dir: Path = PUBLISHED / "qwen-image"
    # Its text encoder is a Qwen2.5-VL, which a scorer such as vqa asks (check_scorers_supported).
    scorer_inputs: frozenset[str] = frozenset({PIPELINE_QWEN_VL})

    def text_conditioning(self, pipe: Any) -> TextConditioning:
        return TextConditioning(pipe.transformer.config.joint_attention_dim, self.max_text_tokens)

    def attention_counters(self, pipe: Any) -> AttentionCounters:
        return pipe.transformer.attention_stats

    def forward_flops(self, transformer_config: dict, width: int, height: int, text_tokens: int) -> float:
        """FLOPs of one DiT forward for one image of width x height pixels with `text_tokens`
        prompt tokens; `transformer_config` is the transformer's config.json contents."""
        config = TransformerConfig.from_dict(transformer_config)
        tokens = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
        return forward_flops(config, tokens, text_tokens)["total"]

    def published_config(self, rel: str, num_layers: int | None = None) -> dict:
        """The published checkpoint's config file `rel` ("transformer/config.json"); with
        `num_layers`, the transformer's cut to that depth (published widths, fewer blocks)."""
        config = json.loads((self.published_dir / rel).read_text())
        return config if num_layers is None else {**config, "num_layers": num_layers}

    def load_pipeline(self, path: str | Path, *args: Any, **kwargs: Any) -> TextToImagePipeline:
        """`model.qwen_image.loader.load_pipeline`: the checkpoint at `path` as a pipeline."""
        from ditfleet.model.qwen_image.loader import load_pipeline

        return load_pipeline(path, *args, **kwargs)


QWEN_IMAGE = QwenImageFamily()
# The tiny model's text encoder is its own small one (model.tiny), no Qwen2.5-VL.
TINY = replace(
    QWEN_IMAGE,
    name="tiny",
    default_buckets=TINY_BUCKETS,
    runs_on_cpu=True,
    bundled_dir=TINY_MODEL_DIR,
    scorer_inputs=frozenset(),
)
