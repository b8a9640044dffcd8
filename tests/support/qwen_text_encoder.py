"""A tiny random Qwen2.5-VL text encoder and a byte-level BPE tokenizer, built in the test (no
weights or tokenizer files fetched): the stand-ins for Qwen-Image's published text encoder."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ditfleet.model.qwen_image.text_encoder import QWEN_IMAGE_TEMPLATE
from tests.support.paths import DATA

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CONFIG = DATA / "tiny-qwen2.5-vl" / "config.json"
# The tokenizer is trained on these (in the prompt template); the tests encode them.
PROMPTS = [
    "a red cube",
    "",
    "a photograph of a small wooden boat drifting on a calm lake at sunrise, mist over the water, "
    "pine trees along the shore, a heron standing on a rock, soft golden light, film grain, "
    "wide angle, the text 'HELLO 123' painted on the hull, reflections, ripples",
]


def make_tokenizer(out: Path):
    from ditfleet.testing.qwen_vl import train_bpe_tokenizer

    return train_bpe_tokenizer(out, [QWEN_IMAGE_TEMPLATE.format(p) for p in PROMPTS] * 4, SPECIAL_TOKENS, 320)


def make_text_encoder(out: Path, seed: int = 0):
    """A two-layer Qwen2.5-VL (hidden 32, 4 heads; mrope sections 1+1+2 = head_dim / 2) with a
    one-block vision tower, random weights, its token ids at the top of the vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**json.loads(TINY_CONFIG.read_text()))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def write_qwen_model_dir(root: Path, seed: int = 0) -> Path:
    """A whole model folder as Qwen-Image lays it out, tiny: diffusers' tiny DiT and VAE (the DiT
    taking the encoder's 32-wide states), the tiny Qwen2.5-VL as text_encoder/ and its tokenizer/."""
    from ditfleet.testing.models import make_diffusers_model_dir

    make_diffusers_model_dir(root, seed, transformer_overrides={"joint_attention_dim": 32})
    make_tokenizer(root / "tokenizer")
    make_text_encoder(root / "text_encoder", seed)
    return root
