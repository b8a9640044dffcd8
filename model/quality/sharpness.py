"""Sharpness: the variance of the Laplacian of an image's luma (a blurred image scores low)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .luma import luma, score_each
from .table import scorer_row


def laplacian_variance(y: torch.Tensor) -> float:
    """Variance of the 3x3 Laplacian [[0,1,0],[1,-4,1],[0,1,0]] over the valid region of y (H, W).

    Written as shifted sums rather than a convolution: elementwise float64 on the CPU, the same
    bits whatever else is in the batch. An image under 3x3 has no valid region and scores 0.
    """
    if y.shape[0] < 3 or y.shape[1] < 3:
        return 0.0
    centre = y[1:-1, 1:-1]  # (H-2, W-2)
    lap = y[:-2, 1:-1] + y[2:, 1:-1] + y[1:-1, :-2] + y[1:-1, 2:] - 4.0 * centre
    return float(lap.var(correction=0))


class Sharpness:
    """Laplacian variance of the BT.601 luma in [0, 1] units, per image."""

    name = "sharpness"
    higher_is_better = scorer_row(name).higher_is_better

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        return score_each(self.name, pixels, prompts, lambda image, _: laplacian_variance(luma(image)))
