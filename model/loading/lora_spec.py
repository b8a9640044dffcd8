"""What a job asks of a LoRA adapter, as plain data (no torch): the job spec builds it without the model."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraSpec:
    """One adapter a job asks for: a local .safetensors file and the strength to merge it with."""

    path: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.scale):
            raise ValueError(f"LoRA {self.path}: scale must be a finite number, got {self.scale}")
