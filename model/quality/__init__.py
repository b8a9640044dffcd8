"""Image scorers: a number per generated image, computed where the image is made (on the actor,
right after decode) or later from the stored file (`ditfleet score`). See base.py for the contract.

`scorer(name)` builds the weight-free scorers by name: `sharpness`, and `tiny` (the bundled tiny
model's adherence check, for captions in its template). perceptual_hash.py gives a hash, not a
score (a 64-bit int does not fit a float exactly), so it is used directly, not registered here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from ditfleet.model.settings import ScorerName

from .base import ImageScorer
from .sharpness import Sharpness
from .tiny_adherence import TinyAdherence

_WEIGHT_FREE: dict[str, Callable[[], ImageScorer]] = {
    Sharpness.name: Sharpness,
    TinyAdherence.name: TinyAdherence,
}
assert set(_WEIGHT_FREE) == set(typing.get_args(ScorerName)), "model.settings.ScorerName names the scorers"


def scorer(name: str) -> ImageScorer:
    """The weight-free scorer called `name`; ValueError naming the known ones otherwise."""
    build = _WEIGHT_FREE.get(name)
    if build is None:
        known = ", ".join(sorted(_WEIGHT_FREE))
        raise ValueError(f"unknown image scorer {name!r}: the weight-free scorers are {known}")
    return build()
