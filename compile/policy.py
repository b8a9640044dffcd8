"""What gets compiled, how, and where it is installed: `apply_compile(pipe, config)`.

Compile is applied from outside the model. The pipeline calls `pipe.vae.decode`, so `decode` is
what is compiled (compiling the VAE module would compile `forward`, which decode never calls):
the compiled callable is installed as the VAE object's own `decode` attribute. Optionally, each
DiT block's two tensor functions around its attention kernel (`attention_inputs`: norm, modulate,
q/k/v, RMS norm, RoPE; `attention_outputs`: projections, gated residuals, MLPs) are compiled the
same way. The block's `forward` (the modulation cache lookup) and the attention kernel (unmasked,
or split by text length, decided per batch) stay eager. The batch size and the text length are
dynamic dimensions, so one graph per function serves every prompt length and batch size of a
resolution bucket; all blocks share one code object, so it is one graph per bucket, not per block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .compiled_method import CompiledMethod, compiled_method, uninstall
from .counting import ensure_counting

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
VAE_LABEL = "vae.decode"
DIT_LABEL = "transformer_blocks.{index}.{method}"
# The compiled DiT block functions and their dynamic dims by argument position: batch (dim 0)
# everywhere, text length on the text tensors and the text RoPE table. The image token count
# stays static (one graph per resolution bucket, specialised to it).
DIT_METHODS: dict[str, dict[int, Any]] = {
    # attention_inputs(img, txt, img_mod, txt_mod, rope=(image Rotation, text Rotation))
    "attention_inputs": {0: (0,), 1: (0, 1), 4: {1: {"cos": (0,), "sin": (0,), "polar": (0,)}}},
    # attention_outputs(img, txt, img_attn, txt_attn, img_mod, txt_mod)
    "attention_outputs": {0: (0,), 1: (0, 1), 2: (0,), 3: (0, 1)},
}
# compile.dit "auto": compile on CUDA when each actor is expected to make at least this many
# images per resolution bucket it warms. Warm-up compiles 2 graphs per bucket (about a minute or
# two on a GPU with autotuned matmuls); a compiled step is expected to save 10-20% of a 20-50
# step image that takes tens of seconds at 1328x1328, so a few dozen images repay it.
AUTO_DIT_IMAGES_PER_BUCKET = 50

Backend = str | Callable[..., Any]


@dataclass(frozen=True)
class CompileConfig:
    """How the worker compiles the pipeline. Backends other than "inductor" ignore the mode.

    dit_mode None means the platform's choice: "max-autotune-no-cudagraphs" on CUDA (autotuned
    matmuls; no CUDA graphs, whose static buffers clash with regional compile and the cache),
    "default" elsewhere (max-autotune on CPU costs minutes for nothing).
    vae_batch: the VAE decodes this many images per compiled call (the last chunk zero-padded),
    so a partial batch never adds a shape; 1 also makes decoding independent of the batch.
    shared_cache: load compiled artifacts from the job's storage before warm-up and save them
    after it (the worker does this with `compile.cache`).
    claim_timeout_s: actors on one machine claim buckets before compiling them, so each bucket
    compiles once (`compile.claims`); a waiter compiles a bucket itself after this long. 0 turns
    the coordination off (every actor compiles every bucket). Not part of the compiled code, so
    not part of the cache key.
    """

    vae: bool = True
    vae_mode: str = "default"
    vae_backend: Backend = "inductor"
    vae_batch: int | None = 1
    dit: bool | str = False  # True, False, or "auto" (see resolve_dit)
    dit_mode: str | None = None
    dit_backend: Backend = "inductor"
    dynamic: bool = False
    fullgraph: bool = True
    shared_cache: bool = True
    claim_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("vae_mode", "dit_mode"):
            mode = getattr(self, name)
            if mode is not None and mode not in COMPILE_MODES:
                raise ValueError(f"CompileConfig.{name} is {mode!r}; use one of {COMPILE_MODES}")
        for name in ("vae_backend", "dit_backend"):
            backend = getattr(self, name)
            if not (isinstance(backend, str) and backend) and not callable(backend):
                raise ValueError(
                    f"CompileConfig.{name} must be a backend name such as 'inductor' or a callable, "
                    f"got {backend!r}"
                )
        if not isinstance(self.dit, bool) and self.dit != "auto":
            raise ValueError(f"CompileConfig.dit must be true, false or 'auto', got {self.dit!r}")
        if not self.claim_timeout_s >= 0:
            raise ValueError(f"CompileConfig.claim_timeout_s must be >= 0, got {self.claim_timeout_s}")
        if self.vae_batch is not None and self.vae_batch < 1:
            raise ValueError(f"CompileConfig.vae_batch must be >= 1 or None, got {self.vae_batch}")

    def mode_for(self, target: str, device_type: str) -> str:
        """The resolved mode of "vae" or "dit" on a device type ("cuda", "cpu", ...)."""
        if target == "vae":
            return self.vae_mode
        if target == "dit":
            if self.dit_mode is not None:
                return self.dit_mode
            return "max-autotune-no-cudagraphs" if device_type == "cuda" else "default"
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
        for target, on in (("vae", self.vae), ("dit", self.dit)):
            if not on:
                out[target] = "off"
                continue
            backend = self.vae_backend if target == "vae" else self.dit_backend
            name = backend if isinstance(backend, str) else getattr(backend, "__qualname__", repr(backend))
            out[target] = f"{name}:{self.mode_for(target, device_type)}"
        out["vae_batch"] = self.vae_batch
        return out


@dataclass
class CompileReport:
    """The compiled targets of one pipeline. Live: statuses change as targets first run."""

    config: CompileConfig
    device_type: str
    methods: dict[str, CompiledMethod] = field(default_factory=dict)

    @property
    def status(self) -> dict[str, str]:
        """label -> 'pending' | 'compiled' | 'eager'."""
        return {label: m.status for label, m in self.methods.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        """label -> why it runs eager, for the targets whose compile failed (empty: none)."""
        return {label: m.fallback_reason for label, m in self.methods.items() if m.fallback_reason}

    @property
    def limit_hits(self) -> int:
        """Calls that ran eager because their target had more shapes than its limit."""
        return sum(m.limit_hits for m in self.methods.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the worker's stats and the job summary."""
        return {
            "settings": self.config.describe(self.device_type),
            "status": self.status,
            "fallbacks": self.fallbacks,
            "limit_hits": self.limit_hits,
        }


def apply_compile(pipe: Any, config: CompileConfig) -> CompileReport:
    """Install compiled `vae.decode` (and DiT block bodies) on a TextToImagePipeline.

    Idempotent: targets already compiled with the same settings are kept. Call it again after
    replacing `pipe.vae` or the transformer: the new objects get their own compiled callables,
    and the old ones go with the old objects. Nothing compiles until the first call; run
    `compile.warm_up` before taking requests.
    """
    ensure_counting()
    device_type = torch.device(pipe.device).type
    if config.dit == "auto":
        raise ValueError("compile.dit is 'auto': resolve it first with resolve_dit(config, ...)")
    report = CompileReport(config, device_type)
    if config.vae:
        report.methods[VAE_LABEL] = compiled_method(
            pipe.vae,
            "decode",
            config.compile_kwargs("vae", device_type),
            label=VAE_LABEL,
            split_batch=config.vae_batch,
        )
    else:
        uninstall(pipe.vae, "decode")
    for block in _blocks(pipe):
        for method, dims in DIT_METHODS.items():
            label = DIT_LABEL.format(index=block.index, method=method)
            if config.dit:
                report.methods[label] = compiled_method(
                    block, method, config.compile_kwargs("dit", device_type), label=label, dynamic_dims=dims
                )
            else:
                uninstall(block, method)
    return report


def resolve_dit(
    config: CompileConfig, device_type: str, expected_images: int | None, buckets: int
) -> CompileConfig:
    """The config with compile.dit "auto" decided: on for CUDA when the images each actor is
    expected to make (None: unknown, taken as many) reach AUTO_DIT_IMAGES_PER_BUCKET per bucket."""
    if config.dit != "auto":
        return config
    enough = expected_images is None or expected_images >= AUTO_DIT_IMAGES_PER_BUCKET * max(1, buckets)
    return replace(config, dit=device_type == "cuda" and enough)


def remove_compile(pipe: Any) -> None:
    """Undo apply_compile: the pipeline runs eager again."""
    uninstall(pipe.vae, "decode")
    for block in _blocks(pipe):
        for method in DIT_METHODS:
            uninstall(block, method)


def compiled_methods(pipe: Any) -> dict[str, CompiledMethod]:
    """The CompiledMethods installed on a pipeline now, by label."""
    found: dict[str, CompiledMethod] = {}
    decode = vars(pipe.vae).get("decode")
    if isinstance(decode, CompiledMethod):
        found[VAE_LABEL] = decode
    for block in _blocks(pipe):
        for method in DIT_METHODS:
            fn = vars(block).get(method)
            if isinstance(fn, CompiledMethod):
                found[DIT_LABEL.format(index=block.index, method=method)] = fn
    return found


def dit_compiled(pipe: Any) -> bool:
    """Whether the DiT blocks of this pipeline run compiled functions."""
    return any(label.startswith("transformer_blocks.") for label in compiled_methods(pipe))


def _blocks(pipe: Any) -> list[Any]:
    return list(pipe.transformer.transformer_blocks)
