"""The Qwen-Image family as the face (model/family.py) sees it: its buckets, compile regions,
memory formula, forward cost and how a checkpoint of it loads. The bundled tiny model is `TINY`,
a configuration of it (same architecture, own sizes, runs on the CPU).

Standard library only (the loader, which needs torch, is imported when a pipeline is loaded):
the job spec and the driver's planning read the defaults without loading torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ditfleet.model.family_types import AttentionCounters, CompileRegion, Size, SourceSizes, TextConditioning
from ditfleet.model.loading.folder import TINY_EDIT_MODEL_DIR, TINY_MODEL_DIR
from ditfleet.model.memory import MemoryPlan, ModelMemory, largest_batch, plan_memory
from ditfleet.model.quality.table import PIPELINE_QWEN_VL
from ditfleet.model.qwen_image.edit import EDIT_STYLES, max_sources_of_class, source_tokens, task_of_class
from ditfleet.model.qwen_image.memory_model import QwenImageMemory
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH_LIMIT
from ditfleet.model.tiny.sizes import TINY_BUCKETS

if TYPE_CHECKING:
    from ditfleet.model.generation.pipeline import TextToImagePipeline
    from ditfleet.model.generation.sampling import PrepareInputs

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
# The model_index.json `_class_name` of its checkpoints (model.family's table maps them here):
# text-to-image, and the edit models on the same DiT (model.qwen_image.edit).
QWEN_IMAGE_PIPELINE_CLASS = "QwenImagePipeline"
QWEN_IMAGE_CLASSES: tuple[str, ...] = (QWEN_IMAGE_PIPELINE_CLASS, *EDIT_STYLES)
# Pixels per latent token side: the VAE's 8x downsampling times the DiT's 2x2 patches.
PIXELS_PER_TOKEN = 16


@dataclass(frozen=True)
class MemoryFormula:
    """How much memory a model of the family needs, from its configs alone (model.memory)."""

    def from_dir(self, root: str | Path, name: str | None = None) -> ModelMemory:
        """The configs of a local model folder (transformer/, vae/, text_encoder/)."""
        return QwenImageMemory.from_dir(root, name=name)

    def from_configs(
        self, transformer: dict, vae: dict, text_encoder: dict | None, name: str = "", where: str = ""
    ) -> ModelMemory:
        """The same from config.json contents read elsewhere (an object store)."""
        return QwenImageMemory.from_configs(transformer, vae, text_encoder, name=name, where=where)

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
        args = (1, height, width, text_len, element_bytes)
        math, fused = (
            model.dit_activation_bytes(*args, attention=a, device="cpu") for a in ("math", "fused")
        )
        return math - fused


def _vae_owners(vae: Any) -> list[tuple[str, Any]]:
    # The pipeline calls `vae.decode`, so decode is what is compiled (compiling the module would
    # compile `forward`, which decoding never calls).
    return [("vae", vae)]


def _vae_encoder_owners(vae: Any) -> list[tuple[str, Any]]:
    # An edit model's VAE encodes its sources (model.qwen_image.edit_sources calls `vae.encode`);
    # a VAE loaded without its encoder (text-to-image) has nothing to compile here.
    return [("vae", vae)] if getattr(vae, "encoder", None) is not None else []


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
        # attention_outputs(img, txt, joint_attn, img_mod, txt_mod); joint_attn is (B, N + L, D)
        "attention_outputs": {0: (0,), 1: (0, 1), 2: (0, 1)},
    }
)

QWEN_IMAGE_COMPILE_REGIONS: tuple[CompileRegion, ...] = (
    CompileRegion("vae", "vae", MappingProxyType({"decode": {}}), _vae_owners),
    CompileRegion("vae", "vae", MappingProxyType({"encode": {}}), _vae_encoder_owners),
    CompileRegion("dit", "transformer", _DIT_BLOCK_METHODS, _block_owners),
)


def forward_flops(
    config: TransformerConfig, img_tokens: int, txt_tokens: int, batch: int = 1, source_tokens: int = 0
) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one DiT forward, from its config: "total", and the share of
    it that is "modulation" (img_mod + txt_mod of one timestep row, what the modulation cache saves).

    Per block: the linears of both streams (q, k, v, out and the 4x MLP) over all T tokens,
    attention (QK^T and AV over T x T), the modulation; plus the input embeddings. An edit
    model's `source_tokens` are image tokens too (T = image + source + text tokens)."""
    img_tokens += source_tokens
    D, T = config.inner_dim, img_tokens + txt_tokens
    linear = 2 * T * (4 * D * D + 2 * 4 * D * D)
    attention = 2 * 2 * T * T * D
    modulation = 2 * 2 * D * 6 * D
    embed = 2 * (img_tokens * config.in_channels * D + txt_tokens * config.joint_attention_dim * D)
    total = config.num_layers * (linear + attention + modulation) + embed
    return {"total": float(batch * total), "modulation": float(batch * config.num_layers * modulation)}


# The family's model at toy widths (the node self-test's --tiny): the published architecture, every
# width small, by config file; `toy_config` fills in the rest from the config classes' defaults.
_TOY_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "transformer/config.json": MappingProxyType(
            {
                "num_layers": 4,
                "num_attention_heads": 2,
                "attention_head_dim": 32,
                "joint_attention_dim": 32,
                "axes_dims_rope": (8, 12, 12),
            }
        ),
        "vae/config.json": MappingProxyType(
            {"base_dim": 16, "z_dim": 16, "dim_mult": (1, 2, 4, 4), "num_res_blocks": 1}
        ),
        # Qwen2.5-VL (the vqa scorer's): the published patching (patch 14, merge 2, two frames), the
        # vision tokens' ids at the top of the small vocabulary.
        "text_encoder/config.json": MappingProxyType(
            {
                "text_config": {
                    "vocab_size": 512,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 4096,
                    "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                },
                "vision_config": {
                    "depth": 2,
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 32,
                    "patch_size": 14,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                    "window_size": 112,
                    "fullatt_block_indexes": [1],
                },
                "image_token_id": 508,
                "video_token_id": 509,
                "vision_start_token_id": 510,
                "vision_end_token_id": 511,
            }
        ),  # fmt: skip
    }
)


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

    def task(self, model_index: dict) -> str:
        """ "edit" for a Qwen-Image-Edit checkpoint (its model_index.json's `_class_name`),
        "text-to-image" otherwise (model.qwen_image.edit)."""
        return task_of_class(model_index.get("_class_name"))

    def max_sources(self, model_index: dict) -> int | None:
        """1 for the first Qwen-Image-Edit, None (any number) for Edit Plus (2509, 2511), 0 for
        text-to-image (model.qwen_image.edit.EDIT_STYLES)."""
        return max_sources_of_class(model_index.get("_class_name"))

    def text_conditioning(self, pipe: Any) -> TextConditioning:
        return TextConditioning(pipe.transformer.config.joint_attention_dim, self.max_text_tokens)

    def attention_counters(self, pipe: Any) -> AttentionCounters:
        return pipe.transformer.attention_stats

    def forward_flops(
        self, transformer_config: dict, width: int, height: int, text_tokens: int, sources: SourceSizes = ()
    ) -> float:
        """FLOPs of one DiT forward for one image of width x height pixels with `text_tokens`
        prompt tokens; `transformer_config` is the transformer's config.json contents. An edit's
        `sources` ((width, height) of each source image, as read) add their tokens at the size the
        VAE encodes them (model.qwen_image.edit.source_tokens) to the image stream."""
        config = TransformerConfig.from_dict(transformer_config)
        tokens = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN) + source_tokens(sources)
        return forward_flops(config, tokens, text_tokens)["total"]

    def published_config(self, rel: str, num_layers: int | None = None) -> dict:
        """The published checkpoint's config file `rel` ("transformer/config.json"); with
        `num_layers`, the transformer's cut to that depth (published widths, fewer blocks)."""
        config = json.loads((self.published_dir / rel).read_text())
        return config if num_layers is None else {**config, "num_layers": num_layers}

    def toy_config(self, rel: str, num_layers: int | None = None) -> dict:
        """`published_config`'s file `rel` at toy widths (the self-test's --tiny): same keys."""
        from ditfleet.model.qwen_image.vae_config import VAEConfig

        if rel == "transformer/config.json":
            config = TransformerConfig(**_TOY_CONFIGS[rel]).to_dict()
            return config if num_layers is None else {**config, "num_layers": num_layers}
        if rel == "vae/config.json":
            return dataclasses.asdict(VAEConfig(**_TOY_CONFIGS[rel]))
        if rel == "text_encoder/config.json":
            return copy.deepcopy(dict(_TOY_CONFIGS[rel]))
        raise KeyError(f"{rel!r}: no toy config; the family has {sorted(_TOY_CONFIGS)}")

    def empty_transformer(self, config: dict) -> Any:
        """The DiT of `config` (a transformer config.json's contents) on the meta device: shapes,
        no storage; `to_empty(device=...)` allocates it, uninitialised."""
        from ditfleet.model.loading.weights import on_meta
        from ditfleet.model.qwen_image.transformer import QwenImageTransformer

        with on_meta():
            return QwenImageTransformer(TransformerConfig.from_dict(config))

    def empty_vae(self, config: dict, with_encoder: bool = True) -> Any:
        """The VAE of `config` on the meta device, like `empty_transformer`; without its encoder
        when only decoding."""
        from ditfleet.model.loading.weights import on_meta
        from ditfleet.model.qwen_image.vae import QwenImageVAE
        from ditfleet.model.qwen_image.vae_config import VAEConfig

        with on_meta():
            return QwenImageVAE(VAEConfig.from_dict(config), with_encoder=with_encoder)

    def write_random_vae(self, out_dir: Path, config: dict, seed: int = 0) -> None:
        """The VAE of `config` (with its encoder) with its own random init, seeded, saved in bf16 in
        diffusers' layout (model.qwen_image.vae.save_vae)."""
        import torch

        from ditfleet.model.qwen_image.vae import QwenImageVAE, save_vae
        from ditfleet.model.qwen_image.vae_config import VAEConfig

        torch.manual_seed(seed)
        save_vae(QwenImageVAE(VAEConfig.from_dict(config), with_encoder=True).to(torch.bfloat16), out_dir)

    def fuse_projections(self, transformer: Any, on: bool = True) -> int:
        """The image stream's q/k/v as one GEMM in every block (QwenImageTransformer.fuse_qkv)."""
        return transformer.fuse_qkv(on)

    def reference_transformer(self, ours: Any, dtype: Any) -> Any:
        """diffusers' transformer on `ours`' weights (cast to `dtype`; shared when the dtype is the
        same), what the self-test checks ours against. `from_config` drops keys an older release does
        not know, so its constructor never sees arguments it lacks."""
        import inspect

        import torch
        from diffusers import QwenImageTransformer2DModel

        config = {k: v for k, v in ours.config.to_dict().items() if not k.startswith("_")}
        with torch.device("meta"):
            ref = QwenImageTransformer2DModel.from_config(config)
        state = {k: v.to(dtype) for k, v in ours.state_dict().items()}
        ref.load_state_dict(state, assign=True, strict=True)
        # Its RoPE tables are computed at construction (on meta here): build them again for real.
        pos = ref.pos_embed
        params = inspect.signature(type(pos)).parameters
        kwargs = {"theta": 10000, "axes_dim": list(ours.config.axes_dims_rope), "scale_rope": True}
        ref.pos_embed = type(pos)(**{k: v for k, v in kwargs.items() if k in params})
        return ref.to(ours.img_in.weight.device).eval().requires_grad_(False)

    def text_width(self, transformer_config: dict) -> int:
        """The width of the prompt embeddings the DiT of `transformer_config` takes."""
        return TransformerConfig.from_dict(transformer_config).joint_attention_dim

    def attention_shape(self, transformer_config: dict) -> tuple[int, int]:
        """(heads, head dim) of the DiT's joint attention."""
        config = TransformerConfig.from_dict(transformer_config)
        return config.num_attention_heads, config.attention_head_dim

    @property
    def prepare_inputs(self) -> PrepareInputs:
        """`model.qwen_image.transformer.prepare_inputs`: what the shared loop hands its DiT."""
        from ditfleet.model.qwen_image.transformer import prepare_inputs

        return prepare_inputs

    def load_text_encoder(self, root: Path, device: Any, dtype: Any) -> Any:
        """`model.qwen_image.loader.load_text_encoder`: Qwen2.5-VL, or the tiny model's own encoder."""
        from ditfleet.model.qwen_image.loader import load_text_encoder

        return load_text_encoder(root, device, dtype)

    def random_text_encoder(
        self, config: dict, tokenizer: Any, device: Any, dtype: Any, seed: int = 0
    ) -> Any:
        """`QwenVLTextEncoder.random`: a Qwen2.5-VL of `config`, random weights made on `device`."""
        from ditfleet.model.qwen_image.text_encoder import QwenVLTextEncoder

        return QwenVLTextEncoder.random(config, tokenizer, device, dtype, seed)

    def dit_config(self, config: dict) -> TransformerConfig:
        return TransformerConfig.from_dict(config)

    def quantize(self, model: Any, mode: Any, layers: Any) -> Any:
        """`model.qwen_image.fp8.quantize_model` with the layer set's kept patterns."""
        from ditfleet.model.loading.quantization import fp8_keep
        from ditfleet.model.qwen_image.fp8 import quantize_model

        return quantize_model(model, mode, fp8_keep(layers))

    def check_quantization_device(self, mode: Any, device: Any) -> None:
        """`model.qwen_image.fp8.check_device`."""
        from ditfleet.model.qwen_image.fp8 import check_device

        check_device(mode, device)

    def runs_scaled_gemms(self, pipe: Any) -> bool:
        """`model.qwen_image.fp8.runs_scaled_gemms` of the pipeline's DiT."""
        from ditfleet.model.qwen_image.fp8 import runs_scaled_gemms

        return runs_scaled_gemms(pipe.transformer)

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
# Its edit variant: the same configuration, its own folder (its model_index.json says edit).
TINY_EDIT = replace(TINY, name="tiny-edit", bundled_dir=TINY_EDIT_MODEL_DIR)
