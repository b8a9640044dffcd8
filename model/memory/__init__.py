"""The memory plan of a model, from its configs alone (nothing here allocates a tensor): weights
per component, activation peaks per image size and batch, and whether it all fits a GPU.

Units: bytes. `e` is the activation element size (2 for bf16, 4 for fp32). Shapes: B batch,
N image tokens ((H/16) * (W/16)), L text tokens, S = L + N, D the DiT width.

- `plan`: `ModelMemory` (what the plan asks of a model's shapes: a protocol each family's memory
  formula meets, e.g. model.qwen_image.memory_model from memory_params and memory_activations),
  `Runtime` (how a batch runs), `MemoryPlan` and `plan_memory` / `largest_batch`;
- `disk`: what a checkpoint holds on disk, from its safetensors headers.

Standard library only: `ditfleet plan` sizes a job without loading torch.
"""

from __future__ import annotations

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
    "largest_batch",
    "plan_memory",
]
