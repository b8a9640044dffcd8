"""How the worker compiles the pipeline, as plain data: `CompileConfig` (no torch here).

The job spec and the driver build and hand this down without importing torch; `compile.policy`
applies it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ditfleet.model.knobs import bounded, check_settings, setting

# The shortest key that authenticates the shared compile cache (compile.cache); the worker's
# key reader checks it without importing torch.
MIN_SECRET_BYTES = 16

# The environment variable that holds that key on every actor's node, unless the job names another.
COMPILE_CACHE_KEY_ENV = "DITFLEET_COMPILE_CACHE_KEY"

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES: tuple[CompileMode, ...] = typing.get_args(CompileMode)

# compile.dit "auto": compile on CUDA when each actor is expected to make at least this many
# images per resolution bucket it warms. Measured on an H200 (node self-test, 60 blocks, bf16):
# a compiled forward takes 236 ms against 274 ms eager at 1328x1328 (1.16x; 125 vs 152 ms at
# 1024, 1.21x), so a 50-step CFG image saves about 3.8 s and a bucket's 75 s compile is repaid
# after about 20 images; 50 leaves room for slower GPUs and smaller speed-ups.
AUTO_DIT_IMAGES_PER_BUCKET = 50
# What a compiled DiT adds to an actor's start-up per resolution bucket it warms, with an empty
# compile cache (2 graphs, autotuned matmuls): 74.6 s measured for the full-depth DiT at 1024 on
# an H200; an actor that loads the shared compile cache pays a few seconds instead (7.5 s there).
DIT_WARMUP_S_PER_BUCKET = (60, 120)


# The mode a compiled DiT gets when compile.dit_mode is not set. bf16 on CUDA: matmuls autotuned
# ("max-autotune"), no CUDA graphs, whose static buffers clash with regional compile and the
# cache. FP8 on CUDA: Inductor's default, cuBLAS for every scaled GEMM. Measured on an H200, the
# search over 106 scaled-GEMM candidates took 3-66 s per shape (8 shapes a bucket: the FP8 DiT's
# compile ran past 4 minutes), and cuBLAS won both large shapes timed (0.100 vs 0.173 ms and
# 0.388 vs 0.697 ms for the best Triton kernel); Triton won only the 129-row text-stream shape,
# about 2% of the FLOPs. Elsewhere "default": max-autotune on CPU costs minutes for nothing.
def default_dit_mode(device_type: str, scaled_gemms: bool = False) -> CompileMode:
    """The DiT's compile mode when compile.dit_mode is not set; `scaled_gemms`: the DiT runs FP8
    GEMMs (model.quantization 'fp8')."""
    if device_type != "cuda":
        return "default"
    return "default" if scaled_gemms else "max-autotune-no-cudagraphs"


# The first compile of a bucket's VAE decode into an empty Inductor cache on CPU actors: 55-57 s
# per actor's first bucket with two actors at once on a 2-core machine, a few seconds for a bucket
# this machine compiled before (the progress line says which).
VAE_FIRST_COMPILE_S_CPU = 50
# Why compile.vae "auto" is off on CPU actors: the compiled decode of one 128x128 tiny-model image
# takes 15.8 ms against 29.2 ms eager on one core, so a bucket's 30-75 s compile is repaid after about
# 4,000 images of that bucket on the machine (docs/performance.md, "The first run").
VAE_CPU_COMPILE_REPAID_AFTER_IMAGES = 4000


def first_compile_estimate_s(device: str, dit: bool) -> int:
    """About how long a bucket's first compile on a machine takes, for the progress line."""
    if dit and device != "cpu":
        return sum(DIT_WARMUP_S_PER_BUCKET) // 2
    return VAE_FIRST_COMPILE_S_CPU


Backend = str | Callable[..., Any]
OnOffAuto = bool | Literal["auto"]  # "auto": the actor decides by its device (and work)


@dataclass(frozen=True)
class CompileConfig:
    """How the worker compiles the pipeline. Backends other than "inductor" ignore the mode.

    dit_mode None means the platform's choice, `default_dit_mode` (it depends on the device and the
    DiT's quantization; `resolve_auto` sets it).
    vae_batch: the VAE decodes this many images per compiled call (the last chunk zero-padded),
    so a partial batch never adds a shape; 1 also makes decoding independent of the batch.
    The knobs written with `setting` say what they do in their descriptions. claim_timeout_s is
    not part of the compiled code, so not part of the cache key.
    """

    vae: OnOffAuto = setting(
        "auto",
        fingerprint="always",  # as the job plans it: the bool for the actors' device
        fingerprint_key="compile_vae",
        description="Compile the VAE decode, warmed once per bucket at actor start-up. 'auto': on for "
        "GPU actors; off on CPU actors, where a bucket's compile (30-75 s on 2 cores) is repaid only after "
        "thousands of images of that bucket.",
    )  # "auto": see vae_on
    vae_mode: CompileMode = "default"
    vae_backend: Backend = "inductor"
    vae_batch: int | None = bounded(1, ge=1)
    dit: OnOffAuto = setting(
        "auto",
        fingerprint="always",  # as the job plans it: off on CPU actors, else as given
        fingerprint_key="compile_dit",
        description="Compile the DiT blocks too: one graph pair per resolution bucket (batch size and "
        "prompt length are dynamic), longer start-up, faster steps on GPUs. 'auto': on for CUDA "
        "actors expected to make enough images per bucket to repay the warm-up.",
    )  # "auto": see dit_on
    dit_mode: CompileMode | None = None
    dit_backend: Backend = "inductor"
    dynamic: bool = False
    fullgraph: bool = True
    shared_cache: bool = setting(
        True,
        description="Share compiled artifacts through the output store, so new actors start faster. "
        "Only blobs authenticated with the fleet's secret key are loaded (they hold executable code); "
        "without a key on the actor's node the shared cache is off.",
    )
    cpu_onednn_linear: bool = True
    claim_timeout_s: float = setting(
        600.0,
        ge=0,
        description="Actors on one machine claim each bucket before compiling it, so a bucket compiles "
        "once per machine and the others load it from the local compile cache; a waiter compiles the "
        "bucket itself after this many seconds (a dead claimant frees it at once). 0: every actor "
        "compiles every bucket.",
    )

    def __post_init__(self) -> None:
        check_settings(self)  # the knobs' bounds and Literal types (the modes), every float knob finite
        for name in ("vae_backend", "dit_backend"):
            backend = getattr(self, name)
            if not (isinstance(backend, str) and backend) and not callable(backend):
                raise ValueError(
                    f"CompileConfig.{name} must be a backend name such as 'inductor' or a callable, "
                    f"got {backend!r}"
                )

    def vae_on(self, device_type: str) -> bool:
        """Whether the VAE decode compiles: compile.vae, with "auto" decided by the device alone (on
        for CUDA, off elsewhere), so every actor of a job, and the plan's fingerprint, agree."""
        if self.vae != "auto":
            return bool(self.vae)
        return device_type == "cuda"

    def dit_on(self, device_type: str, expected_images: int | None = None, buckets: int = 1) -> bool:
        """Whether the DiT compiles: compile.dit, with "auto" decided as on for CUDA when the
        images each actor is expected to make (None: unknown, taken as many) reach
        AUTO_DIT_IMAGES_PER_BUCKET per bucket, and off elsewhere."""
        if self.dit != "auto":
            return bool(self.dit)
        enough = expected_images is None or expected_images >= AUTO_DIT_IMAGES_PER_BUCKET * max(1, buckets)
        return device_type == "cuda" and enough

    def mode_for(self, target: str, device_type: str) -> str:
        """The resolved mode of "vae" or "dit" on a device type ("cuda", "cpu", ...)."""
        if target == "vae":
            return self.vae_mode
        if target == "dit":
            return self.dit_mode if self.dit_mode is not None else default_dit_mode(device_type)
        raise ValueError(f"compile target must be 'vae' or 'dit', got {target!r}")

    def compile_kwargs(self, target: str, device_type: str) -> dict[str, Any]:
        """Keyword arguments for torch.compile of "vae" or "dit" on a device type."""
        backend = self.vae_backend if target == "vae" else self.dit_backend
        kwargs: dict[str, Any] = {"backend": backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if backend == "inductor":
            kwargs["mode"] = self.mode_for(target, device_type)
        return kwargs

    def describe(self, device_type: str) -> dict[str, Any]:
        """JSON-ready settings (what the compile cache key and the worker's stats record)."""
        out: dict[str, Any] = {"dynamic": self.dynamic, "fullgraph": self.fullgraph}
        # "auto" as apply_compile decides it with the image count unknown.
        dit = self.dit_on(device_type)
        for target, on in (("vae", self.vae_on(device_type)), ("dit", dit)):
            if not on:
                out[target] = "off"
                continue
            backend = self.vae_backend if target == "vae" else self.dit_backend
            name = backend if isinstance(backend, str) else getattr(backend, "__qualname__", repr(backend))
            out[target] = f"{name}:{self.mode_for(target, device_type)}"
        out["vae_batch"] = self.vae_batch
        if dit and device_type == "cpu":
            out["dit_linear"] = "onednn" if self.cpu_onednn_linear else "aten"
        return out
