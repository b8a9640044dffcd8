"""What every image scorer is.

A scorer gets the exact pixels that are stored (uint8, so a PNG read back scores the same as the
image on the device) with each image's prompt, and returns one float per image. Scores are
deterministic and batch-independent: an image scores the same alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class ImageScorer(Protocol):
    #: The scorer's name in job files and the suffix of its manifest column, `score_{name}`.
    name: str
    #: The gate keeps the try with the highest score when true, the lowest when false.
    higher_is_better: bool

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        """pixels: (B, 3, H, W) uint8 on any device; prompts: B texts. One float per image."""
        ...
