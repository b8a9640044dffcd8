"""Tiny random-weight Qwen-Image models saved by diffusers' own `save_pretrained`.

These are the reference: our loader must read what diffusers writes, and our outputs must match
what diffusers computes on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.paths import DATA

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
# The scheduler as Qwen-Image publishes it (tests/data/published/SOURCES.md says where from).
PUBLISHED_SCHEDULER = DATA / "published" / "qwen-image" / "scheduler"


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


def text_mask(lens: list[int]) -> torch.Tensor:
    """The attention mask of a batch of prompts `lens` tokens long, right-padded to the longest."""
    mask = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    return mask


def padded_embeds(seed: int, lens: list[int], dim: int = 16, scale: float = 1.0):
    """Stand-in prompt embeddings (random, zero where padded) and their mask."""
    g = torch.Generator().manual_seed(seed)
    mask = text_mask(lens)
    return torch.randn(len(lens), mask.shape[1], dim, generator=g) * scale * mask[..., None], mask


def guided_inputs(
    pos_lens: list[int], neg_lens: list[int], height: int, width: int, dim: int = 16, scale: float = 1.0
) -> dict:
    """Keyword arguments of a true-CFG generation (scale 4) that our `generate` and, through
    `diffusers_images`, the reference take: padded prompt embeddings (seed 0) and negative ones
    (seed 1), and the image size."""
    pos, pos_mask = padded_embeds(0, pos_lens, dim, scale)
    neg, neg_mask = padded_embeds(1, neg_lens, dim, scale)
    return dict(
        prompt_embeds=pos,
        prompt_embeds_mask=pos_mask,
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=neg_mask,
        height=height,
        width=width,
        true_cfg_scale=4.0,
    )


def diffusers_transformer(root: Path, dtype: torch.dtype = torch.float32):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype).eval()


def diffusers_pipeline(root: Path, dtype: torch.dtype = torch.float32):
    """The reference QwenImagePipeline over the same weights, without a text encoder."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype).eval(),
        text_encoder=None,
        tokenizer=None,
        transformer=diffusers_transformer(root, dtype),
    )


def diffusers_images(ref, *, steps: int, seeds: list[int], output_type: str = "pt", **inputs) -> torch.Tensor:
    """What the reference pipeline makes from the keyword arguments our `generate` takes (the
    embeddings, size and guidance in `inputs`), one generator per image as ours seeds them."""
    return ref(
        **inputs,
        num_inference_steps=steps,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type=output_type,
    ).images
