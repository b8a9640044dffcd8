"""The Qwen-Image-style diffusion model: DiT, VAE, scheduler, text encoders, pipeline, loading.

Imports only torch, safetensors and the standard library.
"""

from .loader import load_pipeline, model_revision, resolve_model_dir
from .lora import LoraError, LoraSpec
from .pipeline import TextToImagePipeline
from .transformer import QwenImageTransformer, TransformerConfig
from .weights import WeightsError

__all__ = [
    "LoraError",
    "LoraSpec",
    "QwenImageTransformer",
    "TextToImagePipeline",
    "TransformerConfig",
    "WeightsError",
    "load_pipeline",
    "model_revision",
    "resolve_model_dir",
]
