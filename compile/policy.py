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

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .compiled_method import CompiledMethod, compiled_method, uninstall

# The config lives in the torch-free compile.config (the job spec builds it without torch);
# re-exported here, where it is applied.
from .config import AUTO_DIT_IMAGES_PER_BUCKET, COMPILE_MODES, Backend, CompileConfig  # noqa: F401
from .counting import ensure_counting
from .cpu_linear import restore_linears, use_onednn_linears

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
    dit_linears(pipe.transformer, config, device_type)
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


def dit_linears(transformer: Any, config: CompileConfig, device_type: str) -> None:
    """With the DiT compiled on CPU, its fp32 linears through oneDNN (`compile.cpu_linear`);
    otherwise aten's."""
    if config.dit is True and device_type == "cpu" and config.cpu_onednn_linear:
        use_onednn_linears(transformer)
    else:
        restore_linears(transformer)


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
    restore_linears(pipe.transformer)
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


def _blocks(pipe: Any) -> list[Any]:
    return list(pipe.transformer.transformer_blocks)
