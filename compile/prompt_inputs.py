"""Prompt embeddings for `pipe.generate`: the request path's inputs.

Requests (the worker) and warm-up both build their inputs here, so warm-up traces exactly what
requests run. `encode_unpadded` is the request path: each CFG branch padded only to its own
longest prompt (a compiled DiT takes the text length as a dynamic dimension). `encode_padded` and
`pad_guidance_inputs` pad to prompt-length buckets; they remain for comparisons and benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from model.pipeline import DEFAULT_NEGATIVE_PROMPT

from .buckets import PROMPT_LENGTH_BUCKETS, prompt_length_bucket
from .prompt_padding import pad_prompt_embeds

GuidanceInputs = dict[str, torch.Tensor | None]


def cfg_enabled(true_cfg_scale: float | Sequence[float]) -> bool:
    """The pipeline's rule: true CFG runs when every scale is > 1."""
    scales = true_cfg_scale if isinstance(true_cfg_scale, Sequence) else [true_cfg_scale]
    return all(float(s) > 1 for s in scales)


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


def negatives_per_prompt(prompts: Sequence[str], negative_prompts: Sequence[str] | str | None) -> list[str]:
    """One negative prompt per prompt: the default " " when none is given, a string for all."""
    neg = DEFAULT_NEGATIVE_PROMPT if negative_prompts is None else negative_prompts
    neg_list = [neg] * len(prompts) if isinstance(neg, str) else list(neg)
    if len(neg_list) != len(prompts):
        raise ValueError(
            f"need one negative prompt per prompt: {len(prompts)} prompts, {len(neg_list)} negatives"
        )
    return neg_list


def encode_padded(
    pipe: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | str | None = None,
    true_cfg_scale: float | Sequence[float] = 4.0,
    length_buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS,
    max_sequence_length: int = 512,
) -> GuidanceInputs:
    """Encode prompts (and, when CFG is on, their negatives; default " ") padded to buckets.

    The result goes to `pipe.generate(**inputs, height=..., width=..., ...)`.
    """
    embeds, mask = pipe.encode_prompt(list(prompts), max_sequence_length)
    neg_embeds = neg_mask = None
    if cfg_enabled(true_cfg_scale):
        neg_list = negatives_per_prompt(prompts, negative_prompts)
        neg_embeds, neg_mask = pipe.encode_prompt(neg_list, max_sequence_length)
    return pad_guidance_inputs(
        embeds, mask, neg_embeds, neg_mask, length_buckets, same_length=bool(pipe.cfg_batched)
    )


def encode_unpadded(
    pipe: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | str | None = None,
    true_cfg_scale: float | Sequence[float] = 4.0,
    max_sequence_length: int = 512,
) -> GuidanceInputs:
    """Encode prompts (and, when CFG is on, their negatives; default " ") for `pipe.generate`.

    Each branch is padded only to its own longest prompt (what the encoder returns), since the
    DiT takes any text length. A negative shared by the whole batch (the usual " ") is encoded
    once and expanded, so the unconditional pass is never padded.
    """
    embeds, mask = pipe.encode_prompt(list(prompts), max_sequence_length)
    out: GuidanceInputs = {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": None,
        "negative_prompt_embeds_mask": None,
    }
    if cfg_enabled(true_cfg_scale):
        neg_list = negatives_per_prompt(prompts, negative_prompts)
        if len(set(neg_list)) == 1:
            one, one_mask = pipe.encode_prompt(neg_list[:1], max_sequence_length)  # (1, L, D), (1, L)
            neg_embeds = one.expand(len(prompts), -1, -1)
            neg_mask = one_mask.expand(len(prompts), -1)
        else:
            neg_embeds, neg_mask = pipe.encode_prompt(neg_list, max_sequence_length)
        out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = neg_embeds, neg_mask
    return out


def _ones_if_none(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        return mask
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
