"""Tiny random-weight Qwen-Image models saved by diffusers' own `save_pretrained`.

These are the reference: our loader must read what diffusers writes, and our outputs must match
what diffusers computes on the same weights (tests/support/model_fixtures.py holds the reference
pipeline). Needs diffusers (the `test` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ditfleet.model.loading.quantization import check_quantization
from ditfleet.model.qwen_image.fp8 import check_device
from ditfleet.model.qwen_image.loader import fill_transformer, prepare_transformer
from ditfleet.model.qwen_image.lora import LoraFile, plan_updates
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.model.qwen_image.transformer import QwenImageTransformer
from ditfleet.model.settings import DEFAULT_PIPELINE, Quantization

TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=16,
    axes_dims_rope=(8, 4, 4),
)
TINY_VAE = dict(
    base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
)
# The scheduler as Qwen-Image publishes it (published/SOURCES.md says where from).
PUBLISHED_SCHEDULER = PUBLISHED / "qwen-image" / "scheduler"


def make_diffusers_model_dir(root: Path, seed: int = 0, transformer_overrides: dict | None = None) -> Path:
    """Write transformer/, vae/, scheduler/ with random weights in the diffusers layout."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**{**TINY_TRANSFORMER, **(transformer_overrides or {})})
    g = torch.Generator().manual_seed(seed + 1)
    latents_mean = (torch.randn(16, generator=g) * 0.5).tolist()
    latents_std = (torch.rand(16, generator=g) + 0.5).tolist()
    vae = AutoencoderKLQwenImage(**TINY_VAE, latents_mean=latents_mean, latents_std=latents_std)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(PUBLISHED_SCHEDULER)
    transformer.save_pretrained(root / "transformer")
    vae.save_pretrained(root / "vae")
    scheduler.save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    return root


def add_tiny_text_encoder(root: Path, seed: int = 0) -> Path:
    """Give a model folder a small random word-level text encoder (hidden size = joint_attention_dim)."""
    from ditfleet.model.tiny.text_encoder import TextEncoderConfig, TinyTextEncoder, WordTokenizer

    words = "a the small large red green blue yellow white black circle square triangle at top bottom left right centre on background".split()
    tokenizer = WordTokenizer.from_words(words)
    torch.manual_seed(seed)
    config = TextEncoderConfig(
        vocab_size=len(tokenizer), hidden_size=TINY_TRANSFORMER["joint_attention_dim"], num_heads=2
    )
    TinyTextEncoder(config, tokenizer).save(root)
    return root


def load_transformer(
    component_dir: Path,
    device,
    dtype,
    modulation_cache: str = DEFAULT_PIPELINE.modulation_cache,
    loras: Sequence[LoraFile] = (),
    quantization: Quantization = DEFAULT_PIPELINE.quantization,
) -> QwenImageTransformer:
    """The transformer alone from its folder, as load_pipeline loads it: `loras` are merged into
    the weights as they load (see model/qwen_image/lora.py), before any quantization (model.qwen_image.fp8)."""
    check_device(check_quantization(quantization), device)
    model, checkpoint = prepare_transformer(component_dir, modulation_cache)
    updates = plan_updates(loras, model)  # every adapter key checked before any weight is read
    fill_transformer(model, checkpoint, str(component_dir), dtype, device, updates, quantization)
    return model.eval().requires_grad_(False)


# What a toy edit checkpoint's text encoder is: "tiny", the word-level encoder that cannot see
# images (the sources reach the DiT as latent tokens only; no transformers needed), or "qwen-vl",
# a toy Qwen2.5-VL that sees them (ditfleet.testing.qwen_vl), as the published edit models do.
EDIT_TEXT_ENCODERS = ("tiny", "qwen-vl")


def write_toy_edit_checkpoint(
    out_dir: Path,
    seed: int = 0,
    text_encoder: str = "tiny",
    pipeline_class: str = "QwenImageEditPlusPipeline",
    zero_cond_t: bool = False,
) -> Path:
    """A random Qwen-Image-Edit checkpoint at toy widths that ditfleet loads as an edit model:
    diffusers' own DiT, VAE and scheduler (`make_diffusers_model_dir`), the text encoder of
    `text_encoder` (EDIT_TEXT_ENCODERS), and a model_index.json naming `pipeline_class`
    (Qwen-Image-Edit-2509's QwenImageEditPlusPipeline by default; QwenImageEditPipeline is the
    first edit model). zero_cond_t: the 2511 variant's transformer (its sources modulated at t=0)."""
    if text_encoder not in EDIT_TEXT_ENCODERS:
        raise ValueError(f"text_encoder must be one of {EDIT_TEXT_ENCODERS}, got {text_encoder!r}")
    out_dir = Path(out_dir)
    width = 32 if text_encoder == "qwen-vl" else TINY_TRANSFORMER["joint_attention_dim"]
    overrides: dict = {"joint_attention_dim": width}
    if zero_cond_t:
        overrides["zero_cond_t"] = True
    make_diffusers_model_dir(out_dir, seed, transformer_overrides=overrides)
    components = {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if text_encoder == "qwen-vl":
        from ditfleet.testing.qwen_vl import write_toy_qwen_vl

        write_toy_qwen_vl(out_dir, seed)
        components |= {
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "processor": ["transformers", "Qwen2VLProcessor"],
        }
    else:
        add_tiny_text_encoder(out_dir, seed)
    (out_dir / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class, **components}))
    return out_dir
