"""What gets compiled, how, and where it is installed: `apply_compile(pipe, config)`.

Compile is applied from outside the model. What is compiled is the model family's to say
(`model.family`: its compile regions, each a few methods of some objects of one pipeline
component with their dynamic dimensions); this module installs each compiled callable as the
object's own attribute, so the pipeline calls it in place of the method.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ditfleet.model.family import CompileRegion, model_family, runs_scaled_gemms

from .compiled_method import CompiledMethod, compiled_method, uninstall

# The config lives in the torch-free compile.config (the job spec builds it without torch).
from .config import CompileConfig, default_dit_mode
from .counting import ensure_counting
from .cpu_linear import restore_linears, use_onednn_linears


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
    # "auto" (the default) decided here for a caller that did not: the image count unknown, so
    # on for CUDA and off elsewhere; a worker resolves it itself from the images it expects.
    config = resolve_auto(config, device_type, None, 1, runs_scaled_gemms(pipe))
    report = CompileReport(config, device_type)
    for region in model_family(pipe).compile_regions:
        if region.part == "dit":
            dit_linears(getattr(pipe, region.component), config, device_type)
        on = config.vae if region.part == "vae" else config.dit
        for label, owner, method, dims in region.targets(pipe):
            if on:
                report.methods[label] = compiled_method(
                    owner,
                    method,
                    config.compile_kwargs(region.part, device_type),
                    label=label,
                    **_region_options(region, dims, config),
                )
            else:
                uninstall(owner, method)
    return report


def _region_options(region: CompileRegion, dims: Any, config: CompileConfig) -> dict[str, Any]:
    """compiled_method's keywords for one region: the VAE decode may split its batch
    (compile.vae_batch); a region with dynamic dimensions passes them."""
    options: dict[str, Any] = {}
    if region.part == "vae":
        options["split_batch"] = config.vae_batch
    if dims:
        options["dynamic_dims"] = dict(dims)
    return options


def dit_linears(transformer: Any, config: CompileConfig, device_type: str) -> None:
    """With the DiT compiled on CPU, its fp32 linears through oneDNN (`compile.cpu_linear`);
    otherwise aten's."""
    if config.dit is True and device_type == "cpu" and config.cpu_onednn_linear:
        use_onednn_linears(transformer)
    else:
        restore_linears(transformer)


def resolve_auto(
    config: CompileConfig,
    device_type: str,
    expected_images: int | None,
    buckets: int,
    scaled_gemms: bool = False,
) -> CompileConfig:
    """The config with "auto" decided (CompileConfig.vae_on, dit_on) and the DiT's mode, when not
    set, by the device and whether the DiT runs FP8 GEMMs (default_dit_mode)."""
    dit_mode = config.dit_mode
    if dit_mode is None:
        dit_mode = default_dit_mode(device_type, scaled_gemms)
    return replace(
        config,
        vae=config.vae_on(device_type),
        dit=config.dit_on(device_type, expected_images, buckets),
        dit_mode=dit_mode,
    )


def remove_compile(pipe: Any) -> None:
    """Undo apply_compile: the pipeline runs eager again."""
    for region in model_family(pipe).compile_regions:
        if region.part == "dit":
            restore_linears(getattr(pipe, region.component))
        for _label, owner, method, _dims in region.targets(pipe):
            uninstall(owner, method)


def compiled_methods(pipe: Any) -> dict[str, CompiledMethod]:
    """The CompiledMethods installed on a pipeline now, by label."""
    found: dict[str, CompiledMethod] = {}
    for region in model_family(pipe).compile_regions:
        for label, owner, method, _dims in region.targets(pipe):
            fn = vars(owner).get(method)
            if isinstance(fn, CompiledMethod):
                found[label] = fn
    return found
