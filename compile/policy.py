"""What gets compiled, how, and where it is installed: `apply_compile(pipe, config)`.

Compile is applied from outside the model. The pipeline calls `pipe.vae.decode`, so `decode` is
what is compiled (compiling the VAE module would compile `forward`, which decode never calls):
the compiled callable is installed as the VAE object's own `decode` attribute. Optionally, each
DiT block's `body` (attention + MLP, given the modulation) is compiled the same way; the block's
`forward`, which looks the modulation up in the cache, stays eager, so the cache keeps working.
All blocks share one code object, so Dynamo compiles the body once per input shape, not once per
block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .compiled_method import CompiledMethod, compiled_method, uninstall
from .counting import ensure_counting

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
VAE_LABEL = "vae.decode"
DIT_LABEL = "transformer_blocks.{index}.body"

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
    """

    vae: bool = True
    vae_mode: str = "default"
    vae_backend: Backend = "inductor"
    vae_batch: int | None = 1
    dit: bool = False
    dit_mode: str | None = None
    dit_backend: Backend = "inductor"
    dynamic: bool = False
    fullgraph: bool = True
    shared_cache: bool = True

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
        label = DIT_LABEL.format(index=block.index)
        if config.dit:
            report.methods[label] = compiled_method(
                block, "body", config.compile_kwargs("dit", device_type), label=label
            )
        else:
            uninstall(block, "body")
    return report


def remove_compile(pipe: Any) -> None:
    """Undo apply_compile: the pipeline runs eager again."""
    uninstall(pipe.vae, "decode")
    for block in _blocks(pipe):
        uninstall(block, "body")


def compiled_methods(pipe: Any) -> dict[str, CompiledMethod]:
    """The CompiledMethods installed on a pipeline now, by label."""
    found: dict[str, CompiledMethod] = {}
    decode = vars(pipe.vae).get("decode")
    if isinstance(decode, CompiledMethod):
        found[VAE_LABEL] = decode
    for block in _blocks(pipe):
        body = vars(block).get("body")
        if isinstance(body, CompiledMethod):
            found[DIT_LABEL.format(index=block.index)] = body
    return found


def _blocks(pipe: Any) -> list[Any]:
    return list(pipe.transformer.transformer_blocks)
