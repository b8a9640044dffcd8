"""Zero-padding prompt embeddings to prompt-length buckets (`compile.buckets` holds the lengths).

Kept apart from the bucket arithmetic because it needs torch and the planning side does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .buckets import PROMPT_LENGTH_BUCKETS, BucketError, prompt_length_bucket


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
