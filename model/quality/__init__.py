"""Image scorers: a number per generated image, computed where the image is made (on the actor,
right after decode) or later from the stored file (`ditfleet score`). See base.py for the contract.

`scorer(name, inputs)` builds a scorer by name, one rule for all: each builder takes the
`ScorerInputs` and reads what it needs. Weight-free: `sharpness`, and `tiny` (the bundled tiny
model's adherence check, for captions in its template). Model-based: `vqa` (VQAScore from the
pipeline's own Qwen2.5-VL text encoder) and `clip` (CLIP score from the model in
`inputs.clip_model`). perceptual_hash.py gives a hash, not a score (a 64-bit int does not fit a
float exactly), so it is used directly, not registered here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from ditfleet.model.settings import ScorerName

from .base import ImageScorer, ScorerInputs
from .clip_score import SETTING as CLIP_SETTING
from .clip_score import CLIPScore
from .sharpness import Sharpness
from .tiny_adherence import TinyAdherence
from .vqa import VQAScore


def _vqa(inputs: ScorerInputs) -> ImageScorer:
    if inputs.text_encoder is None:
        raise ValueError(
            "quality.scorers: 'vqa' asks the model's own Qwen2.5-VL text encoder, and this pipeline has "
            "none loaded; use a Qwen-Image checkpoint as model.path"
        )
    return VQAScore.from_text_encoder(inputs.text_encoder)


def _clip(inputs: ScorerInputs) -> ImageScorer:
    if inputs.clip_model is None:
        raise ValueError(
            f"quality.scorers: 'clip' needs {CLIP_SETTING}: a CLIP model (local path, s3:// or hf://)"
        )
    return CLIPScore.load(inputs.clip_model, inputs.device, inputs.dtype)


_BUILDERS: dict[str, Callable[[ScorerInputs], ImageScorer]] = {
    Sharpness.name: lambda _: Sharpness(),
    TinyAdherence.name: lambda _: TinyAdherence(),
    VQAScore.name: _vqa,
    CLIPScore.name: _clip,
}
assert set(_BUILDERS) == set(typing.get_args(ScorerName)), "model.settings.ScorerName names the scorers"


def scorer(name: str, inputs: ScorerInputs | None = None) -> ImageScorer:
    """The scorer called `name`, built from `inputs`; ValueError naming the known ones otherwise."""
    build = _BUILDERS.get(name)
    if build is None:
        known = ", ".join(sorted(_BUILDERS))
        raise ValueError(f"unknown image scorer {name!r}: the scorers are {known}")
    return build(inputs if inputs is not None else ScorerInputs())


__all__ = ["ImageScorer", "ScorerInputs", "scorer"]
