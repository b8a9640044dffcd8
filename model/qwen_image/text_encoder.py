"""Text encoders: anything that turns prompts into (embeddings, mask).

The pipeline only needs `encode(prompts, max_length) -> (embeds (B, L, D), mask (B, L))`, where L
is the longest prompt in tokens and mask is 1 for real tokens. The real encoder is Qwen2.5-VL-7B
through `transformers` (the `qwen` extra); the bundled tiny model has its own small encoder.

Which hidden state Qwen-Image reads: the reference pipeline takes `hidden_states[-1]` of
Qwen2.5-VL, which in the transformers the published encoder was saved with (4.53.1) is the
language model's last hidden state AFTER the final RMSNorm. In transformers 5 that entry is
whatever output capturing records, and with `tie_last_hidden_states=False` in a config it is the
last decoder layer's output before the norm. So we never read `hidden_states[-1]`: a forward
hook captures the final norm's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ditfleet.model.qwen_image.edit import EDIT_DROP_TOKENS, IMAGE_PAD, EditStyle
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH

if TYPE_CHECKING:
    from ditfleet.model.qwen_image.edit_sources import Image

# Qwen-Image's system prompt; its first 34 tokens are dropped from the hidden states.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP_TOKENS = 34
QWEN_TOKENIZER_MAX = 1024


class TextEncoder(Protocol):
    # Read-only: an encoder may hold it as an attribute or compute it (a property).
    @property
    def hidden_size(self) -> int: ...

    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # Optional: `count_tokens(prompts, max_length) -> list[int]`, the L of each prompt's
    # embedding without running the model; the worker batches prompts of like length with it.


class QwenVLTextEncoder:
    """Qwen2.5-VL's last hidden state over Qwen-Image's prompt template."""

    def __init__(
        self, model, tokenizer, device: torch.device, dtype: torch.dtype, image_processor=None
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        # Qwen2-VL's image processor (an edit checkpoint's processor/): prompts with images.
        self.image_processor = image_processor
        self.device, self.dtype = torch.device(device), dtype
        self.hidden_size = int(
            model.config.text_config.hidden_size
            if hasattr(model.config, "text_config")
            else model.config.hidden_size
        )

    @classmethod
    def from_dirs(
        cls, text_encoder_dir: Path, tokenizer_dir: Path, device, dtype, processor_dir: Path | None = None
    ) -> QwenVLTextEncoder:
        """processor_dir: an edit checkpoint's processor/ (its preprocessor_config.json), for
        `encode_edit`. Only its image processor is read: the placeholders are expanded here, so
        no video processor (which wants torchvision) is needed."""
        try:
            from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        except ImportError as e:  # an optional extra
            raise ImportError(
                "the Qwen2.5-VL text encoder needs `transformers`: pip install 'ditfleet[qwen]'"
            ) from e
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(text_encoder_dir), torch_dtype=dtype, local_files_only=True, use_safetensors=True
        )
        images = None
        if processor_dir is not None:
            images = AutoImageProcessor.from_pretrained(str(processor_dir), local_files_only=True)
        return cls(model.to(device).eval(), tok, device, dtype, images)

    def count_tokens(self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH) -> list[int]:
        """Each prompt's embedding length as `encode` makes it (tokenizer only, no model)."""
        texts = [QWEN_IMAGE_TEMPLATE.format(p) for p in prompts]
        ids = self.tokenizer(texts, max_length=QWEN_TOKENIZER_MAX + QWEN_IMAGE_DROP_TOKENS, truncation=True)
        return [min(max(len(t) - QWEN_IMAGE_DROP_TOKENS, 0), max_length) for t in ids["input_ids"]]

    def _final_norm(self) -> torch.nn.Module:
        """The language model's final RMSNorm, wherever this transformers version keeps it
        (`model.language_model.norm` from 4.52, `model.norm` before)."""
        inner = getattr(self.model, "model", self.model)
        norm = getattr(getattr(inner, "language_model", inner), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise RuntimeError(
                f"{type(self.model).__name__}: cannot find the language model's final norm; "
                "this transformers version lays Qwen2.5-VL out differently."
            )
        return norm

    def _last_hidden_state(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **vision: torch.Tensor
    ) -> torch.Tensor:
        """The final norm's output (B, T, D): the state Qwen-Image was trained on (see the module
        docstring), captured by a hook so that no version's `hidden_states` semantics matter."""
        captured: list[torch.Tensor] = []
        handle = self._final_norm().register_forward_hook(lambda m, args, out: captured.append(out))
        try:
            # The multimodal model without the LM head: positions (M-RoPE) as the full model
            # computes them, but no vocabulary-sized logits.
            inner = (
                self.model.model
                if hasattr(getattr(self.model, "model", None), "language_model")
                else self.model
            )
            # vision: pixel_values and image_grid_thw when the prompts hold images (encode_edit).
            inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **vision)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise RuntimeError(f"expected one call of the final norm per encode, saw {len(captured)}")
        return captured[0]

    def to(self, device: str | torch.device) -> QwenVLTextEncoder:
        """Move the encoder (e.g. off the GPU between shards); returns self."""
        self.model.to(device)
        self.device = torch.device(device)
        return self

    @torch.no_grad()
    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [QWEN_IMAGE_TEMPLATE.format(p) for p in prompts]
        tokens = self.tokenizer(
            texts,
            max_length=QWEN_TOKENIZER_MAX + QWEN_IMAGE_DROP_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        hidden = self._last_hidden_state(tokens.input_ids, tokens.attention_mask)  # (B, T, D)
        return self._embeddings(hidden, tokens.attention_mask, QWEN_IMAGE_DROP_TOKENS, max_length)

    @torch.no_grad()
    def encode_edit(
        self,
        prompts: list[str],
        sources: Sequence[Sequence[Image]],
        style: EditStyle,
        max_length: int = MAX_SEQUENCE_LENGTH,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode` for an edit model: each instruction in the edit template with its row's source
        images, which Qwen2.5-VL sees (the processor turns each into its vision tokens), as
        diffusers' QwenImageEdit(Plus)Pipeline encodes them; the first EDIT_DROP_TOKENS dropped."""
        if self.image_processor is None:
            raise ValueError(
                "this Qwen2.5-VL text encoder has no image processor: an edit checkpoint ships "
                "processor/preprocessor_config.json next to text_encoder/; copy it from the published checkpoint."
            )
        from ditfleet.model.qwen_image.edit_sources import resized

        images = [resized(image, style.vision_size(*image.size)) for row in sources for image in row]
        vision = self.image_processor(images=images, return_tensors="pt")
        texts = _expand_image_pads(
            [style.prompt_text(p, len(row)) for p, row in zip(prompts, sources, strict=True)],
            (vision["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist(),
        )
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        hidden = self._last_hidden_state(
            tokens.input_ids,
            tokens.attention_mask,
            pixel_values=vision["pixel_values"].to(self.device),
            image_grid_thw=vision["image_grid_thw"].to(self.device),
        )
        return self._embeddings(hidden, tokens.attention_mask, EDIT_DROP_TOKENS, max_length)

    def _embeddings(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, drop: int, max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D), mask (B, L)) from the final hidden states (B, T, D): each prompt's
        real tokens (padding may sit on either side), minus the template's first `drop`, left-aligned."""
        mask = attention_mask.bool()
        per_prompt = [h[m][drop:][:max_length] for h, m in zip(hidden, mask)]
        longest = max(p.shape[0] for p in per_prompt)
        embeds = hidden.new_zeros(len(per_prompt), longest, hidden.shape[-1])
        out_mask = torch.zeros(len(per_prompt), longest, dtype=torch.long, device=hidden.device)
        for i, p in enumerate(per_prompt):
            embeds[i, : p.shape[0]] = p
            out_mask[i, : p.shape[0]] = 1
        return embeds.to(self.dtype), out_mask


def _expand_image_pads(texts: list[str], tokens_per_image: list[int]) -> list[str]:
    """Each image placeholder's pad token repeated as many times as its image has merged patches,
    images in order across the texts: what Qwen2-VL's processor does to its text before tokenizing."""
    counts = iter(tokens_per_image)
    out = []
    for text in texts:
        parts = text.split(IMAGE_PAD)
        out.append(parts[0] + "".join(IMAGE_PAD * next(counts) + part for part in parts[1:]))
    if next(counts, None) is not None:
        raise ValueError(f"{len(tokens_per_image)} images but fewer placeholders in the prompts")
    return out
