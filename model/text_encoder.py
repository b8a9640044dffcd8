"""Text encoders: anything that turns prompts into (embeddings, mask).

The pipeline only needs `encode(prompts, max_length) -> (embeds (B, L, D), mask (B, L))`, where L
is the longest prompt in tokens and mask is 1 for real tokens. The real encoder is Qwen2.5-VL-7B
through `transformers` (the `qwen` extra); the bundled tiny model has its own small encoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

# Qwen-Image's system prompt; its first 34 tokens are dropped from the hidden states.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP_TOKENS = 34
QWEN_TOKENIZER_MAX = 1024


class TextEncoder(Protocol):
    hidden_size: int

    def encode(self, prompts: list[str], max_length: int = 512) -> tuple[torch.Tensor, torch.Tensor]: ...

    # Optional: `count_tokens(prompts, max_length) -> list[int]`, the L of each prompt's
    # embedding without running the model; the worker batches prompts of like length with it.


class QwenVLTextEncoder:
    """Qwen2.5-VL's last hidden state over Qwen-Image's prompt template."""

    def __init__(self, model, tokenizer, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device, self.dtype = torch.device(device), dtype
        self.hidden_size = int(
            model.config.text_config.hidden_size
            if hasattr(model.config, "text_config")
            else model.config.hidden_size
        )

    @classmethod
    def from_dirs(cls, text_encoder_dir: Path, tokenizer_dir: Path, device, dtype) -> QwenVLTextEncoder:
        try:
            from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        except ImportError as e:  # an optional extra
            raise ImportError(
                "the Qwen2.5-VL text encoder needs `transformers`: pip install 'ditfleet[qwen]'"
            ) from e
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(text_encoder_dir), torch_dtype=dtype, local_files_only=True, use_safetensors=True
        )
        return cls(model.to(device).eval(), tok, device, dtype)

    def count_tokens(self, prompts: list[str], max_length: int = 512) -> list[int]:
        """Each prompt's embedding length as `encode` makes it (tokenizer only, no model)."""
        texts = [QWEN_IMAGE_TEMPLATE.format(p) for p in prompts]
        ids = self.tokenizer(texts, max_length=QWEN_TOKENIZER_MAX + QWEN_IMAGE_DROP_TOKENS, truncation=True)
        return [min(max(len(t) - QWEN_IMAGE_DROP_TOKENS, 0), max_length) for t in ids["input_ids"]]

    def to(self, device: str | torch.device) -> QwenVLTextEncoder:
        """Move the encoder (e.g. off the GPU between shards); returns self."""
        self.model.to(device)
        self.device = torch.device(device)
        return self

    @torch.no_grad()
    def encode(self, prompts: list[str], max_length: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [QWEN_IMAGE_TEMPLATE.format(p) for p in prompts]
        tokens = self.tokenizer(
            texts,
            max_length=QWEN_TOKENIZER_MAX + QWEN_IMAGE_DROP_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.model(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden = out.hidden_states[-1]  # (B, T, D)
        mask = tokens.attention_mask.bool()
        # Keep each prompt's real tokens (padding may sit on either side), minus the template head.
        per_prompt = [h[m][QWEN_IMAGE_DROP_TOKENS:][:max_length] for h, m in zip(hidden, mask)]
        longest = max(p.shape[0] for p in per_prompt)
        embeds = hidden.new_zeros(len(per_prompt), longest, hidden.shape[-1])
        out_mask = torch.zeros(len(per_prompt), longest, dtype=torch.long, device=hidden.device)
        for i, p in enumerate(per_prompt):
            embeds[i, : p.shape[0]] = p
            out_mask[i, : p.shape[0]] = 1
        return embeds.to(self.dtype), out_mask
