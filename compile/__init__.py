"""Compile policy, buckets, warm-up and the fleet-shared compile cache, applied from outside the model."""

from .buckets import (
    PROMPT_LENGTH_BUCKETS,
    QWEN_IMAGE_BUCKETS,
    TINY_BUCKETS,
    BucketError,
    BucketSet,
    ResolutionBucket,
    pad_prompt_embeds,
    pad_to_bucket,
    prompt_length_bucket,
)
from .cache import (
    ArtifactStore,
    CacheKey,
    CacheLoadResult,
    CacheSaveResult,
    CompileCacheWarning,
    DirectoryArtifactStore,
    KernelSnapshot,
    cache_key,
    load_shared_cache,
    save_shared_cache,
)
from .claims import BucketClaims, ClaimOutcome, CompileClaimWarning
from .compiled_method import CompiledMethod, CompileFallbackWarning
from .counting import compile_count, count_compiles
from .policy import CompileConfig, CompileReport, apply_compile, compiled_methods, remove_compile
from .prepare import PreparedPipeline, prepare_worker_pipeline
from .prompt_inputs import encode_padded, encode_unpadded, pad_guidance_inputs
from .warmup import BucketWarmup, WarmupReport, warm_up

__all__ = [
    "PROMPT_LENGTH_BUCKETS",
    "QWEN_IMAGE_BUCKETS",
    "TINY_BUCKETS",
    "ArtifactStore",
    "BucketClaims",
    "BucketError",
    "BucketSet",
    "BucketWarmup",
    "CacheKey",
    "CacheLoadResult",
    "CacheSaveResult",
    "ClaimOutcome",
    "CompileClaimWarning",
    "CompileCacheWarning",
    "CompileConfig",
    "CompileFallbackWarning",
    "CompileReport",
    "CompiledMethod",
    "DirectoryArtifactStore",
    "KernelSnapshot",
    "PreparedPipeline",
    "ResolutionBucket",
    "WarmupReport",
    "apply_compile",
    "cache_key",
    "compile_count",
    "compiled_methods",
    "count_compiles",
    "encode_padded",
    "encode_unpadded",
    "load_shared_cache",
    "pad_guidance_inputs",
    "pad_prompt_embeds",
    "pad_to_bucket",
    "prepare_worker_pipeline",
    "prompt_length_bucket",
    "remove_compile",
    "save_shared_cache",
    "warm_up",
]
