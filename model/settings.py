"""The pipeline's knobs (`PipelineSettings`) and the value sets other layers' knobs name; the
knob machinery (`setting`, `check_settings`) is model.knobs.

Torch-free on purpose: the planning side (the job spec, `ditfleet validate`) imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ditfleet.model.cfg_table import CfgTable, cfg_table_value, parse_cfg_table
from ditfleet.model.knobs import check_settings, setting
from ditfleet.model.step_cache_config import StepCacheConfig, parse_step_cache, step_cache_value

# The longest prompt, in text tokens, that a job embeds by default, and the most it may ask for
# (the largest prompt-length bucket a compiled region is warmed for, compile.buckets).
MAX_SEQUENCE_LENGTH = 512
MAX_SEQUENCE_LENGTH_LIMIT = 1024

ModulationCache = Literal["off", "cfg", "table", "auto"]
CfgMode = Literal["serial", "batched", "auto"]
Quantization = Literal["none", "fp8", "fp8-weight-only"]  # model.quantization names these
Fp8Layers = Literal["safe", "all"]  # model.loading.quantization.FP8_LAYER_SETS: which Linears are FP8
AttentionBackend = Literal[
    "auto", "cudnn", "flash", "efficient", "math"
]  # model.generation.attention_backend


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
        "small to fill it and batching pads little, else serial; with a cfg_table, by its measurement).",
    )
    cfg_table: CfgTable | None = setting(
        None,
        # Which way a step runs changes its rounding: an output keeps the table it was planned with.
        fingerprint="when_set",
        parse=parse_cfg_table,
        dump=cfg_table_value,
        description="A cfg_table.json the node self-test wrote (`--extra cfg_modes`: ms per CFG step "
        "serial and batched per bucket and batch, on the job's GPU kind): cfg_mode 'auto' then picks the "
        "faster per request on a GPU, by the measured bucket at the largest measured batch not above the "
        "request's; a bucket it lacks keeps the fixed rule. Read where the job is planned; null: the fixed rule.",
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
        if self.cfg_table is not None and not isinstance(self.cfg_table, CfgTable):
            raise TypeError(
                "PipelineSettings.cfg_table must be a CfgTable or None (parse_cfg_table reads a "
                f"cfg_table.json), got {self.cfg_table!r}"
            )
        if self.step_cache is not None and not isinstance(self.step_cache, StepCacheConfig):
            raise TypeError(
                "PipelineSettings.step_cache must be a StepCacheConfig or None (parse_step_cache reads a "
                f"preset name or mapping), got {self.step_cache!r}"
            )


DEFAULT_PIPELINE = PipelineSettings()
