"""The Qwen-Image-style diffusion model: DiT, VAE, scheduler, text encoders, pipeline, loading.

Imports only torch, safetensors and the standard library. Names load on first use (PEP 562), so
that the torch-free modules (`model.loading.lora_spec`, the config readers) can be imported by the
planning side without loading torch.
"""

from __future__ import annotations

from ditfleet.model.lazy_exports import lazy_exports

# name -> the submodule that defines it
_WHERE = {
    "LoraError": "qwen_image.lora",
    "ModelFamily": "family",
    "LoraSpec": "loading.lora_spec",
    "QwenImageTransformer": "qwen_image.transformer",
    "TextToImagePipeline": "generation.pipeline",
    "TransformerConfig": "qwen_image.transformer",
    "WeightsError": "loading.weights",
    "load_pipeline": "family",
    "model_family": "family",
    "model_revision": "loading.folder",
    "resolve_model_dir": "family",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
