"""The Qwen-Image-style diffusion model: DiT, VAE, scheduler, text encoders, pipeline, loading.

Imports only torch, safetensors and the standard library. Names load on first use (PEP 562), so
that the torch-free modules (`model.lora_spec`, the config readers) can be imported by the
planning side without loading torch.
"""

from __future__ import annotations

from .lazy_exports import lazy_exports

# name -> the submodule that defines it
_WHERE = {
    "LoraError": "lora",
    "ModelFamily": "family",
    "LoraSpec": "lora_spec",
    "QwenImageTransformer": "transformer",
    "TextToImagePipeline": "pipeline",
    "TransformerConfig": "transformer",
    "WeightsError": "weights",
    "load_pipeline": "loader",
    "model_family": "family",
    "model_revision": "loader",
    "resolve_model_dir": "loader",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
