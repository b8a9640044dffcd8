"""Step-cache settings: the presets, their published sources, and the checks on user input.

Torch-free on purpose: the job spec, `ditfleet validate` and the fingerprint read it without
loading torch. The algorithm itself is `model.generation.step_cache`.

Two methods, both decided per image and per CFG branch (an image never depends on its
batch-mates), both reusing a residual kept at the row's last computed step:

- "dbcache" ("dual block cache", vipshop/cache-dit, docs/DBCache.md): each DiT pass computes the
  first `compute_blocks` blocks (Fn) and measures how much the residual they add, H(t, Fn) -
  H(t, 0), changed since the last step that computed everything, as a relative L1 distance,
  mean|R_t - R_last| / mean|R_last|. Below `threshold`, the remaining blocks are not run: their
  residual at that last computed step is added instead.
- "teacache" (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion
  Model", CVPR 2025): no block runs before the decision. The signal is the first block's
  modulated input (LayerNorm of the image stream, shifted and scaled by the timestep's
  modulation); its relative L1 change since the previous step, rescaled by a polynomial fitted
  to the model (`coefficients`), is summed over steps. While the sum stays below `threshold`
  the row reuses the residual of all blocks; when it computes, the sum restarts at 0.

`taylorseer_order` (either method; TaylorSeer, Liu et al., "From Reusing to Forecasting:
Accelerating Diffusion Models with TaylorSeers", ICCV 2025): a reused row gets its residual
extrapolated from its last computed steps by a Taylor series of finite differences (order 1:
linear in the step index) instead of the last residual repeated.

Presets come from published Qwen-Image settings, not from the bundled tiny model (which forgives
far more than a real model; see docs/performance.md):
- "safe": cache-dit's Qwen-Image example as published (assets/qwen-image.C1_Q0_DBCACHE_F8B0_W8M0MC0_
  T1O4_R0.12_S23.png: Fn_compute_blocks=8, Bn=0, max_warmup_steps=8, no cap on cached steps,
  residual_diff_threshold=0.12), without its TaylorSeer calibrator.
- "fast": TeaCache at vLLM-Omni's Qwen-Image coefficients and the threshold its guide gives for
  "~2.0x speedup with noticeable quality loss" (docs/user_guide/diffusion/teacache.md:
  rel_l1_thresh 0.6), with a first-order TaylorSeer forecast of the reused residual (cache-dit
  pairs its caches with TaylorSeer: `enable_taylorseer=True`), the first 4 steps computed
  (cache-dit's bench/cache sweeps, `--max-warmup-steps 4`) and at most 3 reused steps in a row
  (cache-dit's examples cap continuous cached steps at 2 to 4). Its quality cost is larger; it
  is measured by `ditfleet calibrate`, never assumed.

Chosen by measurement on the tiny model (50 steps, docs/performance.md): at the same work,
TeaCache with TaylorSeer kept 7 dB more PSNR than without it, and more than DBCache with one
computed block; DBCache with Fn 8 is the published setting for the quality end.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

METHODS = ("dbcache", "teacache")
# TeaCache's rescaling polynomial for Qwen-Image's DiT (highest degree first, as numpy.poly1d):
# vLLM-Omni's vllm_omni/diffusion/cache/teacache/config.py, "QwenImageTransformer2DModel", taken
# from ComfyUI-TeaCache's Qwen-Image tuning. It maps the modulated input's relative L1 change to
# an estimate of the output's; a model of another family needs its own fit.
QWEN_IMAGE_TEACACHE_COEFFICIENTS = (-450.0, 280.0, -45.0, 3.2, -0.02)
# Fields only one method reads: naming one for the other method is an error, not a silent no-op.
METHOD_FIELDS = {"compute_blocks": "dbcache", "coefficients": "teacache"}
MAX_TAYLORSEER_ORDER = 2  # higher orders extrapolate the noise of a few finite differences
PRESET_NAMES = ("off", "safe", "fast")
# The spec key users write; errors name it (and the field under it).
SPEC_KEY = "sampling.step_cache"


class StepCacheError(ValueError):
    """A step-cache setting that cannot be used; the message names the key."""


@dataclass(frozen=True)
class StepCacheConfig:
    """One step cache's settings. Build with `parse_step_cache` (presets, checks naming the key)."""

    method: str = "dbcache"
    # dbcache: relative L1 change of the first blocks' residual below which an image reuses the
    # rest; teacache: bound on the summed rescaled change of the modulated input.
    threshold: float = 0.08
    # dbcache's Fn: blocks every pass computes. Capped at a quarter of the model's blocks (at
    # least one), so a model with few blocks keeps blocks to skip; Qwen-Image's 60 take the
    # published values. teacache computes none before deciding.
    compute_blocks: int = 8
    # teacache's rescaling polynomial, highest degree first.
    coefficients: tuple[float, ...] = QWEN_IMAGE_TEACACHE_COEFFICIENTS
    # TaylorSeer: 0 reuses the kept residual as it is; 1-2 extrapolate it over the steps since.
    taylorseer_order: int = 0
    # Steps computed in full before any reuse (the first step always is: nothing is cached yet).
    warmup_steps: int = 8
    # Longest run of reused steps before an image must compute again; -1: no limit.
    max_consecutive_skips: int = 3
    # Steps at the end of the schedule always computed in full.
    exact_last_steps: int = 1
    # Shorter schedules run exact: distilled 4-8 step schedules (Lightning) change too much per
    # step for a residual cache, and the warm-up alone would take most of them.
    min_steps: int = 20

    def __post_init__(self) -> None:
        _check(dataclasses.asdict(self), SPEC_KEY)

    def compute_blocks_for(self, num_layers: int) -> int:
        """Blocks every pass computes before deciding, on a model of `num_layers` blocks."""
        if self.method == "teacache":
            return 0
        return max(1, min(self.compute_blocks, num_layers // 4))

    def kept_tensors(self) -> int:
        """Image-stream tensors (N x D per image) kept per CFG branch for the whole schedule: the
        signal, the residual and one derivative per TaylorSeer order (model.generation.step_cache). The
        memory plan counts them."""
        return 2 + self.taylorseer_order

    def inactive_reason(self, steps: int, num_layers: int | None = None) -> str | None:
        """Why a schedule of `steps` steps (on a model of `num_layers` blocks) runs exact; None
        when the cache can reuse work there."""
        if steps < self.min_steps:
            return f"{steps} steps < min_steps {self.min_steps}"
        if steps - self.warmup_steps - self.exact_last_steps < 2:
            return (
                f"{steps} steps leave fewer than 2 to reuse after warmup_steps {self.warmup_steps} "
                f"and exact_last_steps {self.exact_last_steps}"
            )
        if num_layers is not None and num_layers < 2:
            return f"a model of {num_layers} block has nothing to skip"
        return None

    def most_work_saved(self, steps: int, num_layers: int) -> float:
        """The largest share of a schedule's DiT block work these settings can save: every step
        the warm-up, the exact last steps and the cap on reused steps in a row leave open is
        reused, and a reused dbcache pass still computes its first blocks. What a job saves is
        at most this and depends on its images (the threshold): `ditfleet calibrate` measures it."""
        if self.inactive_reason(steps, num_layers) is not None:
            return 0.0
        open_steps = steps - max(1, self.warmup_steps) - self.exact_last_steps
        k = self.max_consecutive_skips
        reused = open_steps if k < 0 else open_steps * k // (k + 1)
        skipped_blocks = 1.0 - self.compute_blocks_for(num_layers) / num_layers
        return reused / steps * skipped_blocks

    def runs_as(self, num_layers: int) -> str:
        """The settings as the model runs them (compute_blocks clipped to its depth), in words."""
        parts = [f"{self.method}, threshold {self.threshold:g}"]
        if self.method == "dbcache":
            parts.append(f"compute_blocks {self.compute_blocks_for(num_layers)} of {num_layers}")
        if self.taylorseer_order:
            parts.append(f"TaylorSeer order {self.taylorseer_order}")
        parts.append(f"warm-up {self.warmup_steps} steps, last {self.exact_last_steps} exact")
        if self.max_consecutive_skips >= 0:
            parts.append(f"at most {self.max_consecutive_skips} reused in a row")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The settings that act: the field of the other method is left out (a fingerprint must
        not change with a number the images never saw)."""
        out = dataclasses.asdict(self)
        out["coefficients"] = list(self.coefficients)
        for name, method in METHOD_FIELDS.items():
            if method != self.method:
                del out[name]
        return out

    def describe(self) -> str:
        """Canonical JSON (sorted keys): the manifest's record and the fingerprint's value."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


_FIELDS = tuple(f.name for f in dataclasses.fields(StepCacheConfig))


def parse_step_cache(value: Any, key: str = SPEC_KEY) -> StepCacheConfig | None:
    """A preset name, a mapping ({preset?, method?, threshold?, ...} over the preset, default
    "safe"), a StepCacheConfig, or None/False/"off" -> the config, or None for off. The job
    spec calls it once (model.knobs: the knob's `parse`); below it the value is typed.

    Raises StepCacheError naming `key` (and the field) for an unknown preset, method or field, or
    a value out of range.
    """
    if value is None or value is False:  # YAML reads a bare `off` as false
        return None
    if isinstance(value, StepCacheConfig):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise StepCacheError(
                f"{key}: unknown preset {value!r}; use one of {list(PRESET_NAMES)} or a mapping"
            )
        return PRESETS[value]
    if not isinstance(value, dict):
        raise StepCacheError(
            f"{key}: expected a preset name {list(PRESET_NAMES)} or a mapping of {list(_FIELDS)}, "
            f"got {type(value).__name__}"
        )
    fields = dict(value)
    preset = fields.pop("preset", "safe")
    if preset not in PRESETS:
        raise StepCacheError(f"{key}.preset: unknown preset {preset!r}; use one of {list(PRESET_NAMES)}")
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        allowed = ["preset", *_FIELDS]
        close = [m for u in unknown for m in difflib.get_close_matches(u, allowed, n=1, cutoff=0.6)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise StepCacheError(f"{key}: unknown key(s) {unknown}{hint}; allowed: {allowed}")
    base = PRESETS[preset]
    if base is None:
        if fields:
            raise StepCacheError(f"{key}: preset 'off' takes no other keys, got {sorted(fields)}")
        return None
    method = fields.get("method", base.method)
    for name in sorted(set(fields) & set(METHOD_FIELDS)):
        if METHOD_FIELDS[name] != method:
            raise StepCacheError(
                f"{key}.{name}: only method {METHOD_FIELDS[name]!r} reads it; this step cache's "
                f"method is {method!r}"
            )
    merged = {**dataclasses.asdict(base), **fields}
    _check_types(merged, key)
    _check(merged, key)
    return StepCacheConfig(**merged)


def _check_types(fields: dict[str, Any], key: str) -> None:
    wants: dict[str, type | tuple[type, ...]] = {"method": str, "threshold": (int, float)}  # else int
    for name, v in fields.items():
        if name == "coefficients":
            if not isinstance(v, (list, tuple)) or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in v
            ):
                raise StepCacheError(f"{key}.{name}: expected a list of finite numbers, got {v!r}")
            fields[name] = tuple(float(c) for c in v)
            continue
        want = wants.get(name, int)
        if isinstance(v, bool) or not isinstance(v, want):
            raise StepCacheError(f"{key}.{name}: expected {_type_name(want)}, got {v!r}")
    fields["threshold"] = float(fields["threshold"])


def _type_name(want: Any) -> str:
    return "a number" if want == (int, float) else want.__name__


def _check(c: dict[str, Any], key: str) -> None:
    """Ranges; every message names the key the user wrote."""
    if c["method"] not in METHODS:
        raise StepCacheError(f"{key}.method: unknown method {c['method']!r}; use one of {list(METHODS)}")
    if not 0.0 < c["threshold"] < 1.0:
        # cache-dit reads <= 0 as "never cache" and >= 1 as "always cache": neither is a cache.
        raise StepCacheError(f"{key}.threshold: must be in (0, 1), got {c['threshold']!r}")
    if len(c["coefficients"]) != 5:
        # TeaCache's rescaling is a 4th-degree polynomial; every published fit has 5 numbers.
        raise StepCacheError(
            f"{key}.coefficients: expected 5 numbers (a 4th-degree polynomial, highest degree "
            f"first), got {len(c['coefficients'])}"
        )
    if not 0 <= c["taylorseer_order"] <= MAX_TAYLORSEER_ORDER:
        raise StepCacheError(
            f"{key}.taylorseer_order: must be 0 (off) to {MAX_TAYLORSEER_ORDER}, got {c['taylorseer_order']!r}"
        )
    bounds = {
        "compute_blocks": 1,
        "warmup_steps": 0,
        "max_consecutive_skips": -1,
        "exact_last_steps": 0,
        "min_steps": 2,
    }
    for name, low in bounds.items():
        v = c[name]
        if v < low:
            raise StepCacheError(f"{key}.{name}: must be >= {low}, got {v!r}")
    if c["max_consecutive_skips"] == 0:
        raise StepCacheError(
            f"{key}.max_consecutive_skips: 0 would never reuse a step; use -1 (no limit) or >= 1"
        )
    least = c["warmup_steps"] + c["exact_last_steps"] + 2
    if c["min_steps"] < least:
        raise StepCacheError(
            f"{key}.min_steps: {c['min_steps']} leaves no step to reuse after warmup_steps "
            f"{c['warmup_steps']} and exact_last_steps {c['exact_last_steps']}; use at least {least}"
        )


PRESETS: dict[str, StepCacheConfig | None] = {
    "off": None,
    "safe": StepCacheConfig(
        threshold=0.12, compute_blocks=8, warmup_steps=8, max_consecutive_skips=-1, exact_last_steps=1
    ),
    "fast": StepCacheConfig(
        method="teacache",
        threshold=0.6,
        warmup_steps=4,
        max_consecutive_skips=3,
        exact_last_steps=1,
        taylorseer_order=1,
    ),
}


def step_cache_value(config: StepCacheConfig | None) -> str | dict[str, Any]:
    """The setting as the resolved job file and the fingerprint write it: "off", or every setting
    that acts (`parse_step_cache` reads it back as it was)."""
    return "off" if config is None else config.to_dict()


def check_schedule(config: StepCacheConfig | None, steps: int, key: str = SPEC_KEY) -> None:
    """The job's default schedule must be long enough to use its step cache: an error naming the
    key before any work (a per-row shorter schedule runs exact and its manifest row says so)."""
    if config is None:
        return
    reason = config.inactive_reason(steps)
    if reason is not None:
        raise StepCacheError(
            f"{key}: the schedule is too short for a step cache ({reason}); set {key}: off, "
            f"or lower {key}.min_steps / warmup_steps"
        )
