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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([QWEN_IMAGE_TEMPLATE.format(p) for p in PROMPTS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        padding_side="right",
        model_max_length=131072,
    )
    fast.save_pretrained(out)
    return fast


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
