"""Prompt embeddings padded to prompt-length buckets, for comparisons and benchmarks.

The request path does not pad: requests and warm-up encode with the pipeline's
`encode_guidance` (each CFG branch padded only to its own longest prompt; a compiled DiT takes
the text length as a dynamic dimension). `encode_padded` and `pad_guidance_inputs` pad to the
buckets of `compile.buckets`, to measure what that padding costs and to test padding itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ditfleet.model.pipeline import GuidanceInputs
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH

from .buckets import PROMPT_LENGTH_BUCKETS, prompt_length_bucket
from .prompt_padding import pad_prompt_embeds


def pad_guidance_inputs(
    embeds: torch.Tensor,
    mask: torch.Tensor | None,
    negative_embeds: torch.Tensor | None = None,
    negative_mask: torch.Tensor | None = None,
    length_buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS,
    same_length: bool = False,
) -> GuidanceInputs:
    """Pad conditional (and unconditional) embeddings (B, L, D) to their bucket lengths.

    Masks (B, L), 1 = real token; None means all real. same_length pads both branches to the
    longer bucket (batched CFG concatenates them along the batch). Returns the keyword arguments
    of `pipe.generate`: prompt_embeds, prompt_embeds_mask, negative_prompt_embeds,
    negative_prompt_embeds_mask (the last two None without a negative).
    """
    mask = _ones_if_none(embeds, mask)
    length = prompt_length_bucket(embeds.shape[1], length_buckets)
    neg_length = 0
    if negative_embeds is not None:
        negative_mask = _ones_if_none(negative_embeds, negative_mask)
        neg_length = prompt_length_bucket(negative_embeds.shape[1], length_buckets)
        if same_length:
            length = neg_length = max(length, neg_length)
    embeds, mask = pad_prompt_embeds(embeds, mask, length)  # (B, length, D), (B, length)
    out: GuidanceInputs = {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": None,
        "negative_prompt_embeds_mask": None,
    }
    if negative_embeds is not None:
        assert negative_mask is not None
        neg, neg_mask = pad_prompt_embeds(negative_embeds, negative_mask, neg_length)
        out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = neg, neg_mask
    return out


def encode_padded(
    pipe: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str | None] | str | None = None,
    true_cfg_scale: float | Sequence[float] = 4.0,
    length_buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
) -> GuidanceInputs:
    """`pipe.encode_guidance` (model.guidance's CFG rule and negatives), padded to buckets.

    The result goes to `pipe.generate(**inputs, height=..., width=..., ...)`.
    """
    text = pipe.encode_guidance(prompts, negative_prompts, true_cfg_scale, max_sequence_length)
    return pad_guidance_inputs(
        text["prompt_embeds"],
        text["prompt_embeds_mask"],
        text["negative_prompt_embeds"],
        text["negative_prompt_embeds_mask"],
        length_buckets,
        same_length=bool(pipe.cfg_batched),
    )


def _ones_if_none(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        return mask
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
