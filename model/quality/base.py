"""What every image scorer is.

A scorer gets the exact pixels that are stored (uint8, so a PNG read back scores the same as the
image on the device) with each image's prompt, and returns one float per image. Scores are
deterministic and batch-independent: an image scores the same alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


class ImageScorer(Protocol):
    #: The scorer's name in job files and the suffix of its manifest column, `score_{name}`.
    name: str
    #: The gate keeps the try with the highest score when true, the lowest when false.
    higher_is_better: bool

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        """pixels: (B, 3, H, W) uint8 on any device; prompts: B texts. One float per image."""
        ...


@dataclass(frozen=True)
class ScorerInputs:
    """What building a scorer may take beyond its name (model.quality.scorer). The weight-free
    scorers take nothing; the model-based ones read their part, and say which setting to fix
    when it is missing."""

    #: The pipeline's loaded text encoder: `vqa` asks its Qwen2.5-VL (model.qwen_image.text_encoder).
    text_encoder: Any = None
    #: The local model folder of each scorer whose row needs a model of its own (model.quality.table
    #: MODEL), by scorer name: `clip`'s holds a transformers CLIPModel (a remote one is fetched first).
    models: Mapping[str, Path] = field(default_factory=dict)
    #: Where a scorer that loads its own weights (`clip`) puts them, and in what dtype.
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
