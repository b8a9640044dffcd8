"""The Qwen-Image-style diffusion model: DiT, VAE, scheduler, text encoders, pipeline, loading.

Imports only torch, safetensors and the standard library. Names load on first use (PEP 562), so
that the torch-free modules (`model.lora_spec`, the config readers) can be imported by the
planning side without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the submodule that defines it
_WHERE = {
    "LoraError": "lora",
    "LoraSpec": "lora_spec",
    "QwenImageTransformer": "transformer",
    "TextToImagePipeline": "pipeline",
    "TransformerConfig": "transformer",
    "WeightsError": "weights",
    "load_pipeline": "loader",
    "model_revision": "loader",
    "resolve_model_dir": "loader",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
