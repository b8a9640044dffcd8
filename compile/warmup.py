"""Warm-up: run the real request path once per bucket so that requests never compile.

For every resolution bucket and batch size, `warm_up` runs a short and a long prompt through
encode -> denoise with true CFG -> decode, exactly as a request does (the pipeline's `encode_guidance`).
Compiled graphs are specialised to input shapes, and the shapes do not depend on the number of
steps, so 2 steps are enough.

The VAE decode sees only the resolution; a compiled DiT takes the batch size and the text length
as dynamic dimensions (`model.family`), so it too compiles once per resolution. An edit model
(`pipe.task`) also encodes a source per row at every bucket (`pipe.warmup_sources`: one of the
bucket's aspect ratio), so the VAE encode and the DiT's longer image stream compile here too. Before running, it
raises the recompile limit of every compiled target to the number of shapes it is about to trace.

With `claims` (compile.claims), actors on one machine warm the buckets they can claim first and
then the ones others were compiling, which by then come from the local Inductor cache: each
bucket is compiled once per machine, not once per actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ditfleet.model.family import EDIT, TEXT_TO_IMAGE, model_family
from ditfleet.model.generation.guidance import cfg_on
from ditfleet.model.generation.pipeline import GuidanceInputs
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH

from .buckets import ResolutionBucket
from .claims import BucketClaims, ClaimOutcome
from .counting import compile_count
from .policy import compiled_methods

# A short and a long prompt: with the usual tokenizers they land in different length buckets.
# The long prompt comes first: the compiled DiT's graphs are traced (and Inductor's GEMMs
# autotuned) at the first call's text length, so tuning sees a realistic prompt, not 7 tokens.
WARMUP_PROMPTS: tuple[str, ...] = (
    "A wide photograph of an old harbour town at dusk: fishing boats with peeling blue and white "
    "paint rest on wet sand, gulls circle over stacked crates and coiled ropes, warm light spills "
    "from the windows of narrow stone houses climbing the hill, a lighthouse on the far rocks, "
    "thin mist over the water, reflections of lanterns rippling, a cobbled quay with puddles, "
    "a cat asleep on a bench, fine detail, natural colours, soft contrast, 35mm film grain.",
    "a red fox in fresh snow",
)
# For a pipeline without a text encoder: random embeddings of these token counts.
WARMUP_EMBED_LENGTHS: tuple[int, ...] = (77, 7)  # the longer first, as the prompts
NEGATIVE_EMBED_LENGTH = 1  # the default negative prompt (model.generation.guidance) is one token or so


@dataclass(frozen=True)
class WarmupRuns:
    """What warm-up runs at every bucket.

    prompts: encoded when the pipeline has a text encoder; without one, random embeddings of
    `embed_lengths` tokens stand in for them (and a one-token negative).
    batch_sizes: with the DiT compiled, one is enough (the batch is a dynamic dimension).
    """

    prompts: tuple[str, ...] = WARMUP_PROMPTS
    embed_lengths: tuple[int, ...] = WARMUP_EMBED_LENGTHS
    batch_sizes: tuple[int, ...] = (1,)
    steps: int = 2
    true_cfg_scale: float = 4.0
    max_sequence_length: int = MAX_SEQUENCE_LENGTH
    seed: int = 0


@dataclass(frozen=True)
class BucketWarmup:
    bucket: str  # 'WxH'
    seconds: float  # wall time of every run of this bucket, compiles included
    compiles: int  # Dynamo compilations during them (traces: a cache hit counts too)
    runs: int  # pipeline calls made
    # Inductor graph compiles (FX graph cache misses and bypasses): 0 when every graph of the
    # bucket came from the local cache, e.g. because another actor on the machine compiled it.
    inductor_compiles: int = 0
    claim: str = "off"  # compile.claims: claimed | waited | timeout | off
    waited_s: float = 0.0  # time spent waiting for another actor's claim on it


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
    runs: WarmupRuns = WarmupRuns(),
    *,
    on_bucket: Callable[[int, int, str, bool], None] | None = None,
    claims: BucketClaims | None = None,
) -> WarmupReport:
    """Run every bucket once per prompt and batch size; return times and compile counts.

    on_bucket: called as (i, n, 'WxH', first) before bucket i of n (from 1) starts, for progress;
    first: no process on this machine compiled the bucket before (with claims; else True).
    claims: coordinate with other processes on this machine so each bucket compiles once; the
    buckets are then warmed in claim order (those free first), not in the order given.
    """
    resolved = [b if isinstance(b, ResolutionBucket) else ResolutionBucket.parse(b) for b in buckets]
    if not resolved:
        raise ValueError("warm_up needs at least one resolution bucket")
    if not runs.batch_sizes or any(int(b) < 1 for b in runs.batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {list(runs.batch_sizes)}")
    if runs.steps < 1:
        raise ValueError(f"steps must be >= 1, got {runs.steps}")
    methods = compiled_methods(pipe)
    # An edit model's cases carry sources of each bucket's size: built per bucket.
    edit = getattr(pipe, "task", TEXT_TO_IMAGE) == EDIT
    shared = {} if edit else {int(b): _cases(pipe, int(b), runs) for b in runs.batch_sizes}
    traced: list[dict[int, list[GuidanceInputs]]] = [] if edit else [shared]
    # One graph per resolution for each target (the DiT's batch and text length are dynamic);
    # the margin covers a platform that specialises a size after all.
    shapes = 2 * len(resolved) + 2
    for method in methods.values():
        method.fit_shapes(shapes)

    timings: list[BucketWarmup] = []
    start_all, compiles_all = time.perf_counter(), compile_count()

    # Read before any claim of this start creates a lock file.
    before = {b.name for b in resolved if claims is not None and claims.compiled_before(b.name)}

    def announce(bucket: ResolutionBucket) -> None:
        if on_bucket is not None:
            on_bucket(len(timings) + 1, len(resolved), bucket.name, bucket.name not in before)

    def warm(bucket: ResolutionBucket, outcome: ClaimOutcome) -> None:
        cases = shared
        if edit:
            cases = {int(b): _cases(pipe, int(b), runs, bucket) for b in runs.batch_sizes}
            traced.append(cases)
        timings.append(_warm_bucket(pipe, bucket, outcome, cases, runs))

    _each_bucket(resolved, claims, announce, warm)
    return WarmupReport(
        buckets=tuple(timings),
        prompt_lengths=tuple(sorted({n for cases in traced for n in _all_lengths(cases)})),
        batch_sizes=tuple(int(b) for b in runs.batch_sizes),
        seconds=time.perf_counter() - start_all,
        compiles=compile_count() - compiles_all,
        shape_limit=max((m.shape_limit for m in methods.values()), default=0),
        fallbacks={label: m.fallback_reason for label, m in methods.items() if m.fallback_reason},
    )


def _each_bucket(
    buckets: Sequence[ResolutionBucket],
    claims: BucketClaims | None,
    announce: Callable[[ResolutionBucket], None],
    warm: Callable[[ResolutionBucket, ClaimOutcome], None],
) -> None:
    """announce(bucket), then warm(bucket, outcome) for every bucket: in the order given, or with
    claims first the buckets no one else is compiling now, each under its claim, then the others
    once their claimant is done (they then come from the local compile cache)."""
    if claims is None:
        for bucket in buckets:
            announce(bucket)
            warm(bucket, ClaimOutcome("off"))
        return
    held_elsewhere = []
    for bucket in buckets:
        lock = claims.try_claim(bucket.name)
        if lock is None:
            held_elsewhere.append(bucket)
            continue
        announce(bucket)
        with claims.hold(bucket.name, lock) as outcome:
            warm(bucket, outcome)
    for bucket in held_elsewhere:
        announce(bucket)
        with claims.hold(bucket.name) as outcome:
            warm(bucket, outcome)


def _warm_bucket(
    pipe: Any,
    bucket: ResolutionBucket,
    outcome: ClaimOutcome,
    cases: dict[int, list[GuidanceInputs]],
    runs: WarmupRuns,
) -> BucketWarmup:
    """Run every case of every batch size at this bucket's resolution; time and count it."""
    start, compiles, graphs, count = time.perf_counter(), compile_count(), _inductor_compiles(), 0
    for batch, per_batch in cases.items():
        for case in per_batch:
            pipe.generate(
                **case,
                height=bucket.height,
                width=bucket.width,
                steps=runs.steps,
                true_cfg_scale=runs.true_cfg_scale,
                seeds=list(range(runs.seed, runs.seed + batch)),
            )
            count += 1
    return BucketWarmup(
        bucket.name,
        time.perf_counter() - start + outcome.waited_s,
        compile_count() - compiles,
        count,
        _inductor_compiles() - graphs,
        outcome.how,
        outcome.waited_s,
    )


def _inductor_compiles() -> int:
    """Inductor graph compiles so far in this process (FX graph cache misses and bypasses)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"])


def _cases(
    pipe: Any, batch: int, runs: WarmupRuns, bucket: ResolutionBucket | None = None
) -> list[GuidanceInputs]:
    """The generate() inputs of one batch size: one per prompt (or per embedding length); for
    an edit model (`bucket` given) with the sources its warm-up encodes at that bucket."""
    if bucket is not None:
        if pipe.text_encoder is None:
            raise ValueError(
                "warming up an edit model needs its text encoder (the sources go with the prompts)"
            )
        sources = pipe.warmup_sources(bucket.width, bucket.height, batch)
        return [
            pipe.encode_guidance(
                [prompt] * batch, None, runs.true_cfg_scale, runs.max_sequence_length, sources=sources
            )
            for prompt in runs.prompts
        ]
    if pipe.text_encoder is not None:
        return [
            pipe.encode_guidance([prompt] * batch, None, runs.true_cfg_scale, runs.max_sequence_length)
            for prompt in runs.prompts
        ]
    cases: list[GuidanceInputs] = []
    for length in runs.embed_lengths:
        neg = (
            _random_embeds(pipe, batch, NEGATIVE_EMBED_LENGTH, runs.seed + 1)
            if cfg_on(runs.true_cfg_scale)
            else None
        )
        cases.append(
            {
                "prompt_embeds": _random_embeds(pipe, batch, int(length), runs.seed),
                "prompt_embeds_mask": None,
                "negative_prompt_embeds": neg,
                "negative_prompt_embeds_mask": None,
            }
        )
    return cases


def _random_embeds(pipe: Any, batch: int, length: int, seed: int) -> torch.Tensor:
    """(batch, length, the text embedding width) in the pipeline's dtype and device."""
    g = torch.Generator().manual_seed(seed)
    dim = model_family(pipe).text_conditioning(pipe).width
    return torch.randn(batch, length, dim, generator=g).to(pipe.device, pipe.dtype)


def _all_lengths(cases: dict[int, list[GuidanceInputs]]) -> list[int]:
    """Sorted text lengths (both branches) over every case."""
    return sorted(
        {t.shape[1] for per_batch in cases.values() for case in per_batch for k, t in case.items()
         if k.endswith("embeds") and t is not None}
    )  # fmt: skip
