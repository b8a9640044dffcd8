"""Prompt embeddings zero-padded to the prompt-length buckets of `compile.buckets`, for tests and
benchmarks.

The request path does not pad: requests and warm-up encode with the pipeline's
`encode_guidance` (each CFG branch padded only to its own longest prompt; a compiled DiT takes
the text length as a dynamic dimension). These helpers pad to the buckets, to measure what that
padding costs (bench/pipeline_profile.py) and to test that masked padding changes no output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ditfleet.compile.buckets import PROMPT_LENGTH_BUCKETS, BucketError, prompt_length_bucket
from ditfleet.model.generation.pipeline import GuidanceInputs
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH


def pad_prompt_embeds(
    embeds: torch.Tensor, mask: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad text embeddings to `length` tokens along dim 1, masking the padding off.

    embeds: (B, L, D); mask: (B, L), bool or integer (1 = real token). Returns
    (B, length, D) embeddings and a (B, length) mask of the same dtype as `mask`, with zeros
    (False) at the new positions. L == length returns the inputs unchanged.
    """
    if embeds.dim() != 3:
        raise BucketError(f"prompt embeddings must be (B, L, D), got shape {tuple(embeds.shape)}")
    if mask.shape != embeds.shape[:2]:
        raise BucketError(
            f"prompt mask shape {tuple(mask.shape)} does not match embeddings (B, L) = {tuple(embeds.shape[:2])}"
        )
    batch, tokens, dim = embeds.shape
    if tokens > length:
        raise BucketError(f"prompt embeddings have {tokens} tokens, more than the bucket length {length}")
    if tokens == length:
        return embeds, mask
    extra = length - tokens
    embeds = torch.cat([embeds, embeds.new_zeros(batch, extra, dim)], dim=1)  # (B, length, D)
    mask = torch.cat([mask, mask.new_zeros(batch, extra)], dim=1)  # (B, length)
    return embeds, mask


def pad_to_bucket(
    embeds: torch.Tensor, mask: torch.Tensor, buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad (B, L, D) embeddings and their (B, L) mask to prompt_length_bucket(L) tokens."""
    if embeds.dim() != 3:
        raise BucketError(f"prompt embeddings must be (B, L, D), got shape {tuple(embeds.shape)}")
    return pad_prompt_embeds(embeds, mask, prompt_length_bucket(embeds.shape[1], buckets))


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
    """`pipe.encode_guidance` (model.generation.guidance's CFG rule and negatives), padded to buckets.

    The result goes to `pipe.generate(**inputs, height=..., width=..., ...)`.
    """
    text = pipe.encode_guidance(prompts, negative_prompts, true_cfg_scale, max_sequence_length)
    return pad_guidance_inputs(
        text["prompt_embeds"],
        text["prompt_embeds_mask"],
        text["negative_prompt_embeds"],
        text["negative_prompt_embeds_mask"],
        length_buckets,
        same_length=pipe.cfg_mode == "batched",  # both branches in one forward
    )


def _ones_if_none(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        return mask
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
