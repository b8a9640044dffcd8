"""The image scorers, one row each: what every layer decides about a scorer is read from here.

A row says the scorer's name (in job files, `quality.scorers`, and the manifest column
`score_{name}`), what its column holds, whether the gate keeps the highest or the lowest try,
and what it needs besides the image and its prompt:

- NOTHING: weight-free (sharpness, tiny);
- PIPELINE_QWEN_VL: the pipeline's own Qwen2.5-VL text encoder (vqa): a model family without one
  cannot run it (`check_scorers_supported`), and the memory plan counts its forward;
- MODEL: a model of its own, named by the knob `setting` (clip: quality.clip_model): the
  spec requires the setting, the actor fetches that model once per node, the fingerprint records
  it when the scorer judges the gate.

From this table come the scorer names the spec offers (ScorerName), the manifest's score_*
columns (workers.output.manifest), the spec's checks, the fingerprint, the memory plan and the
actor's fetching; the scorer's code is its module here (model.quality.registry builds it).

Standard library only: the job spec and `ditfleet validate` read it without loading torch.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

Needs = Literal["nothing", "pipeline_qwen_vl", "model"]
NOTHING: Needs = "nothing"
PIPELINE_QWEN_VL: Needs = "pipeline_qwen_vl"
MODEL: Needs = "model"


class ScorerOffers(Protocol):
    """What a model family says to the scorers (model.family.ModelFamily has both)."""

    @property
    def name(self) -> str: ...

    @property
    def scorer_inputs(self) -> frozenset[str]: ...


@dataclass(frozen=True)
class ScorerRow:
    """One scorer; see the module docstring."""

    name: str
    doc: str  # what the job file's quality.scorers says of it
    column: str  # what score_{name} holds (the manifest column's doc)
    higher_is_better: bool  # the gate keeps the try with the highest score when true
    needs: Needs = NOTHING
    # MODEL: the knob that names the model (a field of workers.contract.WorkerConfig, shown in the
    # job file's quality section: "clip_model" is quality.clip_model), and what that model is (a
    # folder as transformers' save_pretrained writes it: config.json, *.json, *.txt, *.safetensors).
    setting: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if not (self.needs == MODEL) == (self.setting is not None) == (self.model is not None):
            raise ValueError(
                f"scorer {self.name!r}: a setting and a model are what a scorer that needs a model of its "
                "own gives, and only such a scorer"
            )

    @property
    def setting_key(self) -> str:
        """The job-file key of `setting` ("quality.clip_model"), for errors."""
        return f"quality.{self.setting}"

    @property
    def manifest_column(self) -> str:
        return f"score_{self.name}"

    @property
    def column_doc(self) -> str:
        return f"{self.column} (quality.scorers: {self.name})"


# The scorers, one row each, in the order of their manifest columns.
SCORERS: tuple[ScorerRow, ...] = (
    ScorerRow(
        "sharpness",
        "variance of the Laplacian of the luma",
        "variance of the Laplacian of the image's luma",
        True,
    ),
    ScorerRow(
        "tiny",
        "the tiny model's adherence check: the share of the caption's colour, background, position, "
        "shape and size it reads back; null off its caption template",
        "share of the caption's attributes the tiny model's check reads back",
        True,
    ),
    ScorerRow(
        "vqa",
        "VQAScore: the model's own Qwen2.5-VL text encoder's probability of 'Yes' to 'Does this "
        'figure show "PROMPT"?\', in [0, 1]; a Qwen-Image model only',
        "probability the model's Qwen2.5-VL answers Yes to 'does this figure show the prompt'",
        True,
        PIPELINE_QWEN_VL,
    ),
    ScorerRow(
        "clip",
        "CLIP score: 100 x the cosine of quality.clip_model's image and text embeddings, clipped at 0",
        "CLIP score: 100 x cosine of the image and prompt embeddings, at least 0",
        True,
        MODEL,
        "clip_model",
        "a transformers CLIPModel and CLIPProcessor",
    ),
)

SCORER_NAMES: tuple[str, ...] = tuple(row.name for row in SCORERS)
_BY_NAME = {row.name: row for row in SCORERS}
assert len(_BY_NAME) == len(SCORERS), f"two scorers share a name: {SCORER_NAMES}"

# The names a job may give quality.scorers: a Literal built from SCORERS, so the job spec offers
# and checks exactly these (type checkers see a str).
if TYPE_CHECKING:
    ScorerName = str
else:
    ScorerName = Literal[SCORER_NAMES]


def scorer_row(name: str) -> ScorerRow:
    """The row of scorer `name`; ValueError naming the known scorers otherwise."""
    row = _BY_NAME.get(name)
    if row is None:
        raise ValueError(f"unknown image scorer {name!r}: the scorers are {', '.join(sorted(SCORER_NAMES))}")
    return row


def needing(names: Iterable[str], needs: Needs) -> tuple[ScorerRow, ...]:
    """The rows of `names` (each once, in order) that need `needs`."""
    return tuple(row for row in map(scorer_row, dict.fromkeys(names)) if row.needs == needs)


def check_scorers_supported(
    offers: ScorerOffers | Collection[str], names: Iterable[str], model: str = ""
) -> None:
    """ValueError, before any work, naming the scorer and why, when a scorer among `names` needs
    what the model does not offer. offers: a model family (model.family: its `scorer_inputs`) or
    that collection itself; model: what the message says of the model (e.g. "model.path 'tiny'
    has a tiny text encoder"; default: the family's name)."""
    if isinstance(offers, Collection):
        provides, said = offers, model or "the model offers none"
    else:
        provides, said = offers.scorer_inputs, model or f"the {offers.name} model family has none"
    for row in needing(names, PIPELINE_QWEN_VL):
        if PIPELINE_QWEN_VL not in provides:
            raise ValueError(
                f"quality.scorers: '{row.name}' asks the model's own Qwen2.5-VL text encoder, but {said}. "
                f"Use a Qwen-Image checkpoint as model.path, or leave '{row.name}' out (the tiny model's "
                "own check is the 'tiny' scorer)"
            )
