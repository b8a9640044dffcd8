"""How each scorer of the table (model.quality.table) is built: `scorer(name, inputs)`, one rule
for all: each builder takes the `ScorerInputs` and reads what its row says it needs. Weight-free:
`sharpness`, and `tiny` (the bundled tiny model's adherence check, for captions in its template).
Model-based: `vqa` (VQAScore from the pipeline's own Qwen2.5-VL text encoder) and `clip` (CLIP
score from the model its row's setting names). perceptual_hash.py gives a hash, not a score (a
64-bit int does not fit a float exactly), so it is used directly, not registered here.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import ImageScorer, ScorerInputs
from .clip_score import CLIPScore
from .sharpness import Sharpness
from .table import SCORER_NAMES, scorer_row
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
    folder = inputs.models.get(CLIPScore.name)
    if folder is None:
        raise ValueError(
            f"quality.scorers: 'clip' needs {scorer_row(CLIPScore.name).setting_key}: a CLIP model "
            "(local path, s3:// or hf://)"
        )
    return CLIPScore.load(folder, inputs.device, inputs.dtype)


_BUILDERS: dict[str, Callable[[ScorerInputs], ImageScorer]] = {
    Sharpness.name: lambda _: Sharpness(),
    TinyAdherence.name: lambda _: TinyAdherence(),
    VQAScore.name: _vqa,
    CLIPScore.name: _clip,
}
assert tuple(sorted(_BUILDERS)) == tuple(sorted(SCORER_NAMES)), (
    "each scorer of model.quality.table has a builder"
)


def scorer(name: str, inputs: ScorerInputs | None = None) -> ImageScorer:
    """The scorer called `name`, built from `inputs`; ValueError naming the known ones otherwise."""
    scorer_row(name)  # an unknown name: the error names the known ones
    return _BUILDERS[name](inputs if inputs is not None else ScorerInputs())
