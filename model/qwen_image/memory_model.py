"""A Qwen-Image model's memory as the plan asks it (model.memory.plan.ModelMemory): its configs, and
from them its parameters, its weights as loaded and each phase's activation peak.

The plan (model.memory.plan) owns what every family shares (the phases, the CUDA reserve,
fragmentation, where the text encoder sits); this class owns the shapes, through this family's
formulas (memory_params, memory_activations). Standard library only: `ditfleet plan` sizes a job
without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ditfleet.model.family_types import Size, SourceSizes
from ditfleet.model.loading.folder import read_config
from ditfleet.model.qwen_image.edit import source_size, source_tokens
from ditfleet.model.qwen_image.memory_activations import (
    dit_activation_bytes,
    image_tokens,
    text_encode_activation_bytes,
    vae_decode_activation_bytes,
    vae_encode_activation_bytes,
    vqa_activation_bytes,
)
from ditfleet.model.qwen_image.memory_params import (
    text_encoder_params,
    transformer_params,
    transformer_weight_bytes,
    vae_params,
)
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.qwen_image.vae_config import VAEConfig
from ditfleet.model.settings import DEFAULT_PIPELINE, Fp8Layers, Quantization

# Qwen-Image's prompt template: its 34 leading tokens are dropped, a few trail the prompt.
QWEN_TEMPLATE_TOKENS = 40


@dataclass(frozen=True)
class QwenImageMemory:
    """What sizes a Qwen-Image model: its configs (text_encoder None when the folder has none), and
    for an edit the sources of a row ((width, height) each, `for_sources`): each adds its latent
    tokens (model.qwen_image.edit.source_tokens) to every DiT forward, and a VAE encode."""

    transformer: TransformerConfig
    vae: VAEConfig
    text_encoder: dict[str, Any] | None = None
    name: str = ""
    sources: tuple[Size, ...] = ()

    def for_sources(self, sources: SourceSizes) -> QwenImageMemory:
        return replace(self, sources=tuple(sources))

    @classmethod
    def from_dir(cls, root: str | Path, name: str | None = None) -> QwenImageMemory:
        """Read `transformer/`, `vae/` (and `text_encoder/`) config.json; no weights."""
        root = Path(root)
        te_dir = root / "text_encoder"
        return cls.from_configs(
            read_config(root / "transformer"),
            read_config(root / "vae"),
            read_config(te_dir) if (te_dir / "config.json").is_file() else None,
            name=name or str(root),
            where=str(root),
        )

    @classmethod
    def from_configs(
        cls, transformer: dict, vae: dict, text_encoder: dict | None, name: str = "", where: str = ""
    ) -> QwenImageMemory:
        t_where, v_where = f"{where}/transformer/config.json", f"{where}/vae/config.json"
        te = dict(text_encoder) if text_encoder is not None else None
        model = cls(
            TransformerConfig.from_dict(transformer, where=t_where),
            VAEConfig.from_dict(vae, v_where),
            te,
            name,
        )
        if te is not None:
            try:
                text_encoder_params(te)
            except KeyError as e:
                raise ValueError(f"{where}/text_encoder/config.json: missing key {e}") from e
        return model

    def params(self) -> dict[str, int]:
        # An edit's VAE keeps its encoder (its sources are encoded on the GPU).
        vae = vae_params(self.vae, with_encoder=bool(self.sources))
        out = {"transformer": transformer_params(self.transformer), "vae": vae}
        if self.text_encoder is not None:
            out["text_encoder"] = text_encoder_params(self.text_encoder)
        return out

    def dit_weight_bytes(
        self, e: int, quantization: Quantization = "none", fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers
    ) -> int:
        """The DiT's weights as loaded (memory_params.transformer_weight_bytes)."""
        return transformer_weight_bytes(self.transformer, e, quantization, fp8_layers)

    def dit_activation_bytes(self, *args: Any, **kwargs: Any) -> int:
        """memory_activations.dit_activation_bytes of this DiT (the arguments after its config),
        the sources' tokens in its image stream."""
        return dit_activation_bytes(
            self.transformer, *args, **{**kwargs, "source_tokens": source_tokens(self.sources)}
        )

    def source_encode_activation_bytes(self, batch: int, e: int) -> int:
        """The sources through the VAE's encoder, each at its VAE size: one call per source of a
        row, over the batch's rows (model.qwen_image.edit_sources); 0 without sources."""
        sizes = [source_size(w, h) for w, h in self.sources]
        return max((vae_encode_activation_bytes(self.vae, batch, h, w, e) for w, h in sizes), default=0)

    def fp8_transient_bytes(
        self, quantization: Quantization, batch: int, height: int, width: int, text_len: int, e: int
    ) -> int:
        """What the FP8 GEMMs (model.qwen_image.fp8) hold beyond the bf16 forward's tensors at its
        peak (the MLP down-projection): `fp8` the scaled copy's FP8 codes of its 4D-wide input, one
        byte per element (the scaled copy itself takes the freed up-projection's place);
        `fp8-weight-only` the largest weight dequantized, and its cast, for the duration of one GEMM."""
        D = self.transformer.inner_dim
        if quantization == "fp8":
            return batch * max(image_tokens(height, width) + source_tokens(self.sources), text_len) * 4 * D
        if quantization == "fp8-weight-only":
            return 2 * 4 * D * D * e
        return 0

    def vae_decode_activation_bytes(self, batch: int, height: int, width: int, e: int) -> int:
        return vae_decode_activation_bytes(self.vae, batch, height, width, e)

    def text_encode_activation_bytes(self, text_len: int, e: int) -> int | None:
        """Encoding one prompt of the DiT's text length (Qwen2.5-VL adds its template's tokens);
        None without a text encoder."""
        if self.text_encoder is None:
            return None
        tokens = text_len + (QWEN_TEMPLATE_TOKENS if self.scores_vqa else 0)
        return text_encode_activation_bytes(self.text_encoder, tokens, e)

    @property
    def scores_vqa(self) -> bool:
        """Whether its text encoder is a Qwen2.5-VL (vision tower and all), what vqa asks."""
        return self.text_encoder is not None and "vision_config" in self.text_encoder

    def vqa_activation_bytes(self, height: int, width: int, text_len: int, e: int) -> int | None:
        """Scoring one image with vqa on its text encoder; None when the encoder cannot."""
        if self.text_encoder is None or not self.scores_vqa:
            return None
        return vqa_activation_bytes(self.text_encoder, height, width, text_len, e)

    def modulation_table_bytes(self, steps: int, e: int) -> int:
        """The 'table' modulation cache of schedules `steps` long in all: per step and block,
        both streams' six D-wide modulation vectors."""
        return steps * self.transformer.num_layers * 2 * 6 * self.transformer.inner_dim * e

    def image_tensor_bytes(self, height: int, width: int, e: int) -> int:
        """One image-stream tensor (N x D) of one image: the unit a step cache keeps."""
        return image_tokens(height, width) * self.transformer.inner_dim * e
