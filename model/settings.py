"""Settings defined once: a knob's default, type, bounds and description live on its dataclass field.

Each layer owns a frozen dataclass of the knobs it uses (`PipelineSettings` here; `CompileConfig`,
`ModelPlacement`, `DispatchConfig`, ... above) and writes every knob with `setting(...)`. The job
spec's pydantic sections are derived from these fields (jobs/spec/derive.py), so the file format,
its validation and its documentation cannot drift from what the code below uses, and a new knob
is one field here plus the code that reads it.

Torch-free on purpose: the planning side (the job spec, `ditfleet validate`) imports it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ditfleet.model.generation.step_cache_config import StepCacheConfig, parse_step_cache, step_cache_value

# The longest prompt, in text tokens, that a job embeds by default, and the most it may ask for
# (the largest prompt-length bucket a compiled region is warmed for, compile.buckets).
MAX_SEQUENCE_LENGTH = 512
MAX_SEQUENCE_LENGTH_LIMIT = 1024

# The metadata keys `setting` understands; bounds as pydantic (and `operator`) name them.
BOUNDS = ("ge", "gt", "le", "lt")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    description: str,
    default_factory: Any = dataclasses.MISSING,
    fingerprint: Literal["always", "when_set", "when"] | None = None,
    fingerprint_key: str | None = None,
    fingerprint_when: Callable[[Any], bool] | None = None,
    parse: Callable[[Any], Any] | None = None,
    dump: Callable[[Any], Any] | None = None,
    **bounds: float,
) -> Any:
    """A dataclass field that is a user-facing knob.

    description: what the knob does, as the job file's documentation says it.
    bounds: ge / gt / le / lt, checked by the spec (and by `check_settings`).
    fingerprint: the knob changes the stored bytes of an image, so the plan's fingerprint records
      it (jobs.spec.derive.fingerprint_entries), under `fingerprint_key` or its name: "always", or
      "when_set": only when it differs from its default, so that outputs planned before the knob
      existed keep their fingerprint; "when": whenever `fingerprint_when(settings)` holds for the
      settings object that owns the knob (a knob that matters only beside another one).
    parse, dump: for a knob whose value is a typed object: what the job file's value becomes (the
      spec calls it, once) and the JSON form written back (the resolved spec, the fingerprint).
    """
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"setting(): unknown bounds {sorted(unknown)}; use {BOUNDS}")
    metadata: dict[str, Any] = {"description": description, **bounds}
    if (fingerprint == "when") != (fingerprint_when is not None):
        raise TypeError('setting(): fingerprint="when" goes with fingerprint_when, and only it')
    if fingerprint is not None:
        metadata.update(
            fingerprint=fingerprint, fingerprint_key=fingerprint_key, fingerprint_when=fingerprint_when
        )
    if parse is not None:
        metadata.update(parse=parse, dump=dump)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def settings_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The knobs of a settings dataclass (fields written with `setting`), by name, in order."""
    return {f.name: f for f in dataclasses.fields(cls) if "description" in f.metadata}


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def check_settings(obj: Any) -> None:
    """Check every knob of a settings dataclass against its Literal type and bounds (the same
    ones the job spec checks), so that code building the dataclass directly gets the same limits.

    A float knob is finite, bounded or not: no knob means anything by infinity (a knob without a
    limit says so with null), and a NaN passes every comparison (a gate's `min: .nan` would fail
    every image) and is not JSON (`_job.json`). The job spec refuses the same (jobs.spec.sections)."""
    hints = typing.get_type_hints(type(obj))
    name = type(obj).__name__
    for f in settings_fields(type(obj)).values():
        value = getattr(obj, f.name)
        allowed = literal_values(hints[f.name])
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}.{f.name} must be one of {allowed}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value!r}")
        if value is None or not any(b in f.metadata for b in BOUNDS):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value!r}")
        for bound in BOUNDS:
            if bound in f.metadata and not getattr(operator, bound)(value, f.metadata[bound]):
                raise ValueError(f"{name}.{f.name} must be {bound} {f.metadata[bound]}, got {value!r}")


def literal_values(tp: Any) -> tuple | None:
    """The values a Literal type (or a union holding Literals) allows; None if it is not one."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    args = typing.get_args(tp)
    if args and any(typing.get_origin(a) is Literal for a in args):
        values: list = []
        for a in args:
            if typing.get_origin(a) is Literal:
                values += typing.get_args(a)
            elif a is type(None):
                values.append(None)
            elif a is bool:
                values += [True, False]
            else:
                return None  # a Literal next to a free type: not a closed set
        return tuple(values)
    return None


ModulationCache = Literal["off", "cfg", "table", "auto"]
CfgMode = Literal["serial", "batched", "auto"]
Quantization = Literal["none", "fp8", "fp8-weight-only"]  # model.quantization names these
Fp8Layers = Literal["safe", "all"]  # model.loading.quantization.FP8_LAYER_SETS: which Linears are FP8
AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]  # model.networks.attention_backend
# The image scorers (model.quality's registry, which checks it holds exactly these); each has its
# manifest column, score_{name} (workers.output.manifest).
ScorerName = Literal["sharpness", "tiny", "vqa", "clip"]


def resolve_modulation_cache(mode: str, device_type: str) -> str:
    """The modulation-cache mode that runs on a device of `device_type` ("cuda", "cpu"): 'auto'
    is 'table' on a GPU, where the per-step modulation GEMVs (13.6 GB of weights read a step at
    Qwen-Image size) cost milliseconds a step and the table's memory is small beside the DiT, and
    'cfg' on the CPU; any other mode is itself."""
    if mode != "auto":
        return mode
    return "table" if device_type == "cuda" else "cfg"


@dataclass(frozen=True)
class PipelineSettings:
    """How the pipeline computes, beyond which weights, device and dtype (`load_pipeline`)."""

    modulation_cache: ModulationCache = setting(
        "auto",
        description="Reuse block modulations: 'cfg' computes them once per step for both CFG passes, "
        "'table' once per bucket schedule per actor (about 220 MB per 50-step bucket at Qwen-Image "
        "size; jobs without CFG gain too), 'auto' 'table' on a GPU and 'cfg' on the CPU. Outputs are "
        "identical.",
    )
    max_sequence_length: int = setting(
        MAX_SEQUENCE_LENGTH,
        ge=1,
        le=MAX_SEQUENCE_LENGTH_LIMIT,
        fingerprint="always",
        description="Longest prompt, in text tokens.",
    )
    cfg_mode: CfgMode = setting(
        "auto",
        fingerprint="always",
        description="How the two true-CFG passes of a step run: 'serial' (two forwards of the batch; "
        "the modulation cache computes the step's modulation once), 'batched' (one forward of twice "
        "the batch, text padded to the longer branch), 'auto' (batched on a GPU while a pass is too "
        "small to fill it and batching pads little, else serial).",
    )
    quantization: Quantization = setting(
        "none",
        fingerprint="when_set",
        description="DiT weights in FP8 (half the memory: 20.5 instead of 40.9 GB at Qwen-Image size). "
        "'fp8': FP8 weights and activations, the GEMMs on FP8 matrix units (GPUs of compute capability "
        "8.9+: L4, L40S, H100, H200; or the CPU); 'fp8-weight-only': FP8 weights computed in bf16 (any GPU, "
        "e.g. A100); 'none': the exact weights. Changes pixels: see docs/real-model.md for the measured cost.",
    )
    fp8_layers: Fp8Layers = setting(
        "safe",
        fingerprint="when",
        # "all" is the set every FP8 output planned before this knob used: such outputs keep their
        # fingerprint when they name it, and one resumed with another set is refused.
        fingerprint_when=lambda s: s.quantization != "none" and s.fp8_layers != "all",
        description="Which DiT Linears a quantization stores in FP8 (model.loading.quantization): 'safe' "
        "keeps each block's image MLP down-projection (img_mlp.net.2) in the load dtype, as SGLang's "
        "ModelOpt recipe does, for 2.3 GB more at Qwen-Image size; 'all' quantizes it too (faster, "
        "measurably worse images). No effect without a quantization.",
    )

    step_cache: StepCacheConfig | None = setting(
        None,
        fingerprint="when_set",
        parse=parse_step_cache,
        dump=step_cache_value,
        description="Approximate step caching (model.step_cache: DBCache or TeaCache, optionally with a "
        "TaylorSeer forecast): 'off' (exact), 'safe', 'fast', or a mapping {preset, method, threshold, "
        "compute_blocks (dbcache), coefficients (teacache), taylorseer_order, warmup_steps, "
        "max_consecutive_skips, exact_last_steps, min_steps} over a preset. It changes pixels: run "
        "`ditfleet calibrate` on your model first (docs/performance.md).",
    )

    attention_backend: AttentionBackend = setting(
        "auto",
        fingerprint="when_set",
        description="The SDPA kernel the DiT and VAE prefer on CUDA (model.attention_backend): 'auto' "
        "(SDPA's own order), 'cudnn', 'flash', 'efficient', or 'math' (the reference, slow). The others "
        "stay behind the preferred one for shapes it does not take. No effect on the CPU.",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.step_cache is not None and not isinstance(self.step_cache, StepCacheConfig):
            raise TypeError(
                "PipelineSettings.step_cache must be a StepCacheConfig or None (parse_step_cache reads a "
                f"preset name or mapping), got {self.step_cache!r}"
            )


DEFAULT_PIPELINE = PipelineSettings()
