"""Warm-up: run the real request path once per bucket so that requests never compile.

For every resolution bucket and batch size, `warm_up` runs a short and a long prompt through
encode -> pad to the prompt-length bucket -> denoise with true CFG -> decode, exactly as a request
does (`compile.prompt_inputs`). Compiled graphs are specialised to input shapes, and the shapes
do not depend on the number of steps, so 2 steps are enough.

The VAE decode sees only the resolution. A compiled DiT also sees the text length and whether a
mask is present, so then every prompt-length bucket a request can reach is traced too, each with
and without padding (a prompt that exactly fills its bucket has an all-ones mask, which the
pipeline drops). Before running, it raises the recompile limit of every compiled target to the
number of shapes it is about to trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .buckets import PROMPT_LENGTH_BUCKETS, ResolutionBucket, prompt_length_bucket
from .counting import compile_count
from .policy import DIT_LABEL, compiled_methods
from .prompt_inputs import GuidanceInputs, cfg_enabled, encode_padded, pad_guidance_inputs

# A short and a long prompt: with the usual tokenizers they land in different length buckets.
WARMUP_PROMPTS: tuple[str, ...] = (
    "a red fox in fresh snow",
    "A wide photograph of an old harbour town at dusk: fishing boats with peeling blue and white "
    "paint rest on wet sand, gulls circle over stacked crates and coiled ropes, warm light spills "
    "from the windows of narrow stone houses climbing the hill, a lighthouse on the far rocks, "
    "thin mist over the water, reflections of lanterns rippling, a cobbled quay with puddles, "
    "a cat asleep on a bench, fine detail, natural colours, soft contrast, 35mm film grain.",
)
# For a pipeline without a text encoder: random embeddings of these token counts.
WARMUP_EMBED_LENGTHS: tuple[int, ...] = (7, 77)
NEGATIVE_EMBED_LENGTH = 1  # the default negative prompt " " is one token or so


@dataclass(frozen=True)
class BucketWarmup:
    bucket: str  # 'WxH'
    seconds: float  # wall time of every run of this bucket, compiles included
    compiles: int  # Dynamo compilations during them
    runs: int  # pipeline calls made


@dataclass(frozen=True)
class WarmupReport:
    buckets: tuple[BucketWarmup, ...]
    prompt_lengths: tuple[int, ...]  # padded text lengths traced (both CFG branches)
    batch_sizes: tuple[int, ...]
    seconds: float
    compiles: int
    shape_limit: int
    fallbacks: dict[str, str]  # compiled target -> why it runs eager

    def seconds_per_bucket(self) -> dict[str, float]:
        return {b.bucket: b.seconds for b in self.buckets}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def warm_up(
    pipe: Any,
    buckets: Sequence[ResolutionBucket | str],
    *,
    prompts: Sequence[str] = WARMUP_PROMPTS,
    embed_lengths: Sequence[int] = WARMUP_EMBED_LENGTHS,
    extra_lengths: Sequence[int] | None = None,
    length_buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS,
    batch_sizes: Sequence[int] = (1,),
    steps: int = 2,
    true_cfg_scale: float = 4.0,
    max_sequence_length: int = 512,
    pad_to_prompt_bucket: bool = True,
    seed: int = 0,
) -> WarmupReport:
    """Run every bucket once per prompt case and batch size; return times and compile counts.

    prompts: encoded when the pipeline has a text encoder; without one, random embeddings of
    `embed_lengths` tokens stand in for them.
    extra_lengths: more text lengths (tokens) to trace with random embeddings, each padded to
    its bucket. None: with the DiT compiled, every prompt-length bucket up to that of
    max_sequence_length (a request may hit any of them, and each is a DiT graph); else none
    (the VAE decode does not see the text).
    pad_to_prompt_bucket=False traces the raw lengths (for comparisons only: requests are padded).
    """
    resolved = [b if isinstance(b, ResolutionBucket) else ResolutionBucket.parse(b) for b in buckets]
    if not resolved:
        raise ValueError("warm_up needs at least one resolution bucket")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    methods = compiled_methods(pipe)
    dit_compiled = any(label == DIT_LABEL.format(index=0) for label in methods)
    buckets_for_lengths = length_buckets if pad_to_prompt_bucket else (max_sequence_length,)
    cases = {
        int(b): _cases(
            pipe, int(b), prompts, embed_lengths, buckets_for_lengths, true_cfg_scale,
            max_sequence_length, pad_to_prompt_bucket, seed,
        )
        for b in batch_sizes
    }  # fmt: skip
    covered = _all_lengths(cases)
    if extra_lengths is None:
        top = prompt_length_bucket(max_sequence_length, length_buckets)
        extra_lengths = (
            [b for b in length_buckets if b <= top] if dit_compiled and pad_to_prompt_bucket else []
        )
    for length in extra_lengths:
        padded = (
            prompt_length_bucket(int(length), buckets_for_lengths) if pad_to_prompt_bucket else int(length)
        )
        if padded not in covered:
            for batch, per_batch in cases.items():
                per_batch.append(_masked(pipe, batch, int(length), padded, true_cfg_scale, seed))
    lengths = _all_lengths(cases)
    if dit_compiled:
        # A prompt that exactly fills its bucket has an all-ones mask, which the pipeline drops:
        # the DiT body then runs without a mask, another graph for every length.
        for batch, per_batch in cases.items():
            per_batch += [_unmasked(pipe, batch, length, true_cfg_scale, seed) for length in lengths]
    # Every (resolution, text length, batch, masked or not) is a separate graph of the DiT body.
    shapes = len(resolved) * max(1, len(lengths)) * len(batch_sizes) * (2 if dit_compiled else 1) + 1
    for method in methods.values():
        method.fit_shapes(shapes)

    timings = []
    start_all, compiles_all = time.perf_counter(), compile_count()
    for bucket in resolved:
        start, compiles, runs = time.perf_counter(), compile_count(), 0
        for batch, per_batch in cases.items():
            for case in per_batch:
                pipe.generate(
                    **case,
                    height=bucket.height,
                    width=bucket.width,
                    steps=steps,
                    true_cfg_scale=true_cfg_scale,
                    seeds=list(range(seed, seed + batch)),
                )
                runs += 1
        timings.append(
            BucketWarmup(bucket.name, time.perf_counter() - start, compile_count() - compiles, runs)
        )
    fallbacks = {label: m.fallback_reason for label, m in methods.items() if m.fallback_reason}
    return WarmupReport(
        buckets=tuple(timings),
        prompt_lengths=tuple(lengths),
        batch_sizes=tuple(int(b) for b in batch_sizes),
        seconds=time.perf_counter() - start_all,
        compiles=compile_count() - compiles_all,
        shape_limit=max((m.shape_limit for m in methods.values()), default=0),
        fallbacks=fallbacks,
    )


def _cases(
    pipe: Any,
    batch: int,
    prompts: Sequence[str],
    prompt_lengths: Sequence[int],
    length_buckets: Sequence[int],
    true_cfg_scale: float,
    max_sequence_length: int,
    pad: bool,
    seed: int,
) -> list[GuidanceInputs]:
    """The generate() inputs of one batch size: one per prompt (or per embedding length)."""
    cases: list[GuidanceInputs] = []
    if pipe.text_encoder is not None:
        for prompt in prompts:
            cases.append(
                encode_padded(
                    pipe, [prompt] * batch, None, true_cfg_scale, length_buckets, max_sequence_length
                )
            )
    else:
        for length in prompt_lengths:
            embeds = _random_embeds(pipe, batch, int(length), seed)
            neg = None
            if cfg_enabled(true_cfg_scale):
                neg = _random_embeds(pipe, batch, NEGATIVE_EMBED_LENGTH, seed + 1)
            cases.append(
                pad_guidance_inputs(
                    embeds, None, neg, None, length_buckets, same_length=bool(pipe.cfg_batched)
                )
            )
    return cases if pad else [_strip_padding(c) for c in cases]


def _random_embeds(pipe: Any, batch: int, length: int, seed: int) -> torch.Tensor:
    """(batch, length, joint_attention_dim) in the pipeline's dtype and device."""
    g = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    return torch.randn(batch, length, dim, generator=g).to(pipe.device, pipe.dtype)


def _unmasked(pipe: Any, batch: int, length: int, true_cfg_scale: float, seed: int) -> GuidanceInputs:
    """Both branches `length` tokens long, every token real (all-ones masks)."""
    embeds = _random_embeds(pipe, batch, length, seed)
    ones = torch.ones(batch, length, dtype=torch.long, device=embeds.device)
    cfg = cfg_enabled(true_cfg_scale)
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": ones,
        "negative_prompt_embeds": _random_embeds(pipe, batch, length, seed + 1) if cfg else None,
        "negative_prompt_embeds_mask": ones if cfg else None,
    }


def _masked(
    pipe: Any, batch: int, length: int, padded: int, true_cfg_scale: float, seed: int
) -> GuidanceInputs:
    """A `length`-token prompt padded to `padded` tokens, and a one-token negative likewise."""
    embeds = _random_embeds(pipe, batch, padded, seed)
    mask = torch.zeros(batch, padded, dtype=torch.long, device=embeds.device)
    mask[:, : min(length, padded - 1)] = 1  # at least one padded token, so the mask is kept
    cfg = cfg_enabled(true_cfg_scale)
    neg_mask = torch.zeros_like(mask)
    neg_mask[:, 0] = 1
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": _random_embeds(pipe, batch, padded, seed + 1) if cfg else None,
        "negative_prompt_embeds_mask": neg_mask if cfg else None,
    }


def _all_lengths(cases: dict[int, list[GuidanceInputs]]) -> list[int]:
    """Sorted text lengths (both branches) over every case."""
    return sorted(
        {t.shape[1] for per_batch in cases.values() for case in per_batch for k, t in case.items()
         if k.endswith("embeds") and t is not None}
    )  # fmt: skip


def _strip_padding(case: GuidanceInputs) -> GuidanceInputs:
    """Cut each branch back to its real tokens (all rows share the same prompt here)."""
    out = dict(case)
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        embeds, mask = case[key], case[f"{key}_mask"]
        if embeds is None or mask is None:
            continue
        real = int(mask.sum(dim=1).max())
        out[key], out[f"{key}_mask"] = embeds[:, :real], mask[:, :real]
    return out
