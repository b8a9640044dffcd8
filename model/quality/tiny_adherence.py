"""The bundled tiny model's adherence check as a score: the share of a caption's five attributes
(shape colour, background, position, kind, size) that plain image analysis reads back from the
image (model.tiny.adherence). It needs no weights, so the embedded default can show scoring, and a
gate on it, with no download. A prompt outside the tiny model's caption template cannot be judged:
its score is NaN (a null in a score table), never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ditfleet.model.tiny.adherence import measure
from ditfleet.model.tiny.scenes import parse_caption

from .luma import score_each
from .table import scorer_row

#: The attributes a caption states, as (the caption's field, the measurement's field).
ATTRIBUTES = (("color", "color"), ("background", "background"), ("position", "position"),
              ("shape", "kind"), ("size", "size"))  # fmt: skip


class TinyAdherence:
    """Share of the caption's attributes measured in the image, in [0, 1] (NaN: not a caption)."""

    name = "tiny"
    higher_is_better = scorer_row(name).higher_is_better

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        return score_each(self.name, pixels, prompts, self._one)

    @staticmethod
    def _one(image: torch.Tensor, prompt: str) -> float:
        try:
            want = parse_caption(prompt)
        except ValueError:
            return math.nan
        got = measure(image.to("cpu", torch.float32) / 255.0)  # (3, H, W) in [0, 1]
        hits = sum(getattr(want, w) == getattr(got, g) for w, g in ATTRIBUTES)
        return hits / len(ATTRIBUTES)
