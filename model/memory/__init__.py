"""The memory plan of a model, from its configs alone (nothing here allocates a tensor): weights
per component, activation peaks per image size and batch, and whether it all fits a GPU.

Units: bytes. `e` is the activation element size (2 for bf16, 4 for fp32). Shapes: B batch,
N image tokens ((H/16) * (W/16)), L text tokens, S = L + N, D the DiT width.

- `model.qwen_image.memory_params`: parameter counts per component (the Qwen-Image family's);
- `model.qwen_image.memory_activations`: activation peaks of the DiT forward, the VAE decode,
  the prompt encode and the vqa score (the Qwen-Image family's);
- `plan`: `ModelMemory` (the configs), `Runtime` (how a batch runs), `MemoryPlan` and
  `plan_memory` / `largest_batch`;
- `disk`: what a checkpoint holds on disk, from its safetensors headers.

Standard library only: `ditfleet plan` sizes a job without loading torch.
"""

from __future__ import annotations

from ditfleet.model.qwen_image.memory_activations import (
    dit_activation_bytes,
    vae_decode_activation_bytes,
    vae_encode_activation_bytes,
    vqa_activation_bytes,
)
from ditfleet.model.qwen_image.memory_params import text_encoder_params, transformer_params, vae_params

from .disk import CheckpointSize, checkpoint_size
from .plan import (
    DTYPE_BYTES,
    GB,
    TEXT_ENCODER_PLACEMENTS,
    MemoryPlan,
    ModelMemory,
    Runtime,
    largest_batch,
    plan_memory,
)

__all__ = [
    "DTYPE_BYTES",
    "GB",
    "TEXT_ENCODER_PLACEMENTS",
    "CheckpointSize",
    "MemoryPlan",
    "ModelMemory",
    "Runtime",
    "checkpoint_size",
    "dit_activation_bytes",
    "largest_batch",
    "plan_memory",
    "text_encoder_params",
    "transformer_params",
    "vae_decode_activation_bytes",
    "vae_encode_activation_bytes",
    "vae_params",
    "vqa_activation_bytes",
]
