"""A tiny random CLIPModel with its processor, saved like a hub snapshot (built in the test: no
weights or tokenizer files fetched): a character-level CLIP BPE vocabulary with no merges."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch


def write_clip_model(out: Path, seed: int = 0) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=32, patch_size=8,
        ),
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    CLIPModel(config).eval().save_pretrained(out, safe_serialization=True)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(out)
    return out
