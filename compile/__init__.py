"""Compile policy, buckets, warm-up and the fleet-shared compile cache, applied from outside the model.

Names load on first use (PEP 562): `from compile.buckets import BucketSet` or
`from compile import CompileConfig` must not import torch, because the job spec and the driver's
planning (`ditfleet validate`, `ditfleet plan`) use them; the modules that compile import torch.
"""

from __future__ import annotations

from ditfleet.model.lazy_exports import lazy_exports

# name -> the submodule that defines it
_WHERE = {
    "BucketError": "buckets",
    "BucketSet": "buckets",
    "PROMPT_LENGTH_BUCKETS": "buckets",
    "ResolutionBucket": "buckets",
    "default_buckets": "buckets",
    "prompt_length_bucket": "buckets",
    "ArtifactStore": "cache",
    "CacheKey": "cache",
    "CacheLoadResult": "cache",
    "CacheSaveResult": "cache",
    "CompileCacheWarning": "cache",
    "DirectoryArtifactStore": "cache",
    "KernelSnapshot": "cache",
    "cache_key": "cache",
    "load_shared_cache": "cache",
    "save_shared_cache": "cache",
    "BucketClaims": "claims",
    "ClaimOutcome": "claims",
    "CompileClaimWarning": "claims",
    "CompileFallbackWarning": "compiled_method",
    "CompiledMethod": "compiled_method",
    "compile_count": "counting",
    "count_compiles": "counting",
    "CompileConfig": "config",
    "CompileReport": "policy",
    "apply_compile": "policy",
    "compiled_methods": "policy",
    "remove_compile": "policy",
    "PreparedPipeline": "prepare",
    "prepare_worker_pipeline": "prepare",
    "BucketWarmup": "warmup",
    "WarmupReport": "warmup",
    "WarmupRuns": "warmup",
    "warm_up": "warmup",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
