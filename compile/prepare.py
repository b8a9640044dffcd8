"""An actor's start-up in one call: shared cache in, compile, warm up, shared cache out.

    report = prepare_worker_pipeline(pipe, config, buckets, artifact_store=store, cache_secret=key)

Order matters: the shared artifacts must be loaded before anything compiles, and saved only
after the warm-up compiled every bucket. With nothing to compile (vae=False, dit=False) there is
nothing to warm or share, and it returns at once. Without the fleet's secret key nothing is
loaded from or saved to the store (compile.cache authenticates every blob with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditfleet.model.family import runs_scaled_gemms

from .buckets import PROMPT_LENGTH_BUCKETS, ResolutionBucket
from .cache import (
    ArtifactStore,
    CacheLoadResult,
    CacheSaveResult,
    KernelSnapshot,
    cache_key,
    inductor_cache_dir,
    load_shared_cache,
    save_shared_cache,
)
from .claims import BucketClaims
from .policy import CompileConfig, CompileReport, apply_compile, resolve_auto
from .warmup import WarmupReport, WarmupRuns, warm_up


@dataclass
class PreparedPipeline:
    """What start-up did; `fallbacks` and `to_dict()` go into the worker's stats."""

    compile: CompileReport
    warmup: WarmupReport | None
    cache_load: CacheLoadResult | None
    cache_save: CacheSaveResult | None
    seconds: float

    @property
    def fallbacks(self) -> dict[str, str]:
        """Compiled targets that run eager, with the reason (empty: none)."""
        return self.compile.fallbacks

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.compile.to_dict(),
            "warmup": self.warmup.to_dict() if self.warmup else None,
            "cache_load": _result(self.cache_load),
            "cache_save": _result(self.cache_save),
            "seconds": round(self.seconds, 3),
        }


def prepare_worker_pipeline(
    pipe: Any,
    config: CompileConfig,
    buckets: Sequence[ResolutionBucket | str],
    artifact_store: ArtifactStore | None = None,
    cache_secret: bytes | None = None,
    *,
    runs: WarmupRuns = WarmupRuns(),
    expected_images: int | None = None,
    on_bucket: Callable[[int, int, str, bool], None] | None = None,
) -> PreparedPipeline:
    """Compile and warm `pipe` for `buckets`, through the shared cache when a store and the
    secret key that authenticates its blobs are given.

    runs: what warm-up runs at every bucket (its batch sizes are part of the shared cache key).
    expected_images: images this actor is expected to make; decides compile.dit "auto".
    on_bucket: called as (i, n, 'WxH', first) before warm-up of bucket i of n starts (progress;
    first: not compiled on this machine before, compile.warmup).
    """
    start = time.perf_counter()
    device_type = torch.device(pipe.device).type
    config = resolve_auto(config, device_type, expected_images, len(buckets), runs_scaled_gemms(pipe))
    report = apply_compile(pipe, config)
    if not report.methods:
        return PreparedPipeline(report, None, None, None, time.perf_counter() - start)
    share = config.shared_cache and artifact_store is not None and cache_secret is not None
    # The prompt-length buckets are part of the key only: requests are not padded to them.
    key = cache_key(pipe, config, buckets, PROMPT_LENGTH_BUCKETS, runs.batch_sizes)
    loaded = None
    if share and artifact_store is not None and cache_secret is not None:
        loaded = load_shared_cache(artifact_store, key, cache_secret)
    snapshot = KernelSnapshot.take() if share else None
    # Actors starting together on this machine split the buckets instead of each compiling all.
    claims = (
        BucketClaims(inductor_cache_dir(), key.name, config.claim_timeout_s)
        if config.claim_timeout_s > 0
        else None
    )
    warm = warm_up(pipe, buckets, runs, on_bucket=on_bucket, claims=claims)
    saved = None
    unloaded = loaded is None or loaded.status != "loaded"
    if share and artifact_store is not None and cache_secret is not None and unloaded:
        saved = save_shared_cache(artifact_store, key, cache_secret, since=snapshot)
    return PreparedPipeline(report, warm, loaded, saved, time.perf_counter() - start)


def _result(result: CacheLoadResult | CacheSaveResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    out = dict(vars(result))
    out["seconds"] = round(out["seconds"], 3)
    return out
