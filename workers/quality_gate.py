"""Scores taken where each image is made, and the quality gate that makes an image again when it
scores too low (quality.scorers, quality.gate).

    for made in scored_images(generator, requests, batch_size, scorers, gate):
        made.image, made.scores, made.gate   # the kept try, its scores, every try's record

Every image is scored from the uint8 pixels that will be stored (model.quality: a score depends on
the image and its prompt alone), and the image that comes out gets its perceptual hash, whatever
the job's scorers: the near-duplicate counts of `ditfleet status` and `ditfleet report` read it.
The hash is cheap next to the image's DiT work (26 ms at 1024x1024 on one CPU thread), and only
the kept try is hashed. Without a gate each image comes out as it is made. With one, the tries go
in rounds: round t makes try t (workers.generate.try_seed) of every image that has not passed yet,
batched like any other work; an image comes out when a try passes (score >= min), when the scorer
cannot judge it (NaN: kept as made), when its generation failed on the first try (a failure is not
a quality question), or after `max_tries` with its best try. Only the kept try's pixels ever leave
this module, so a try that lost is never stored and leaves nothing behind; the rounds, the seeds
and the decisions depend only on the shard's rows, so a rerun of the shard makes the same tries.

Memory: an image under the gate holds its best try's pixels (uint8) until it comes out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ditfleet.model.quality.base import ImageScorer
from ditfleet.model.quality.perceptual_hash import perceptual_hashes
from ditfleet.workers.contract import GateConfig
from ditfleet.workers.generate import (
    BatchGenerator,
    GeneratedImage,
    ImageRequest,
    iter_generated,
    plan_batches,
)


@dataclass(frozen=True)
class GateRecord:
    """Every try of one image under the gate, in try order, and which one was kept."""

    scores: tuple[float | None, ...]  # the gate's score of each try (None: the try failed or is NaN)
    seeds: tuple[int, ...]
    kept: int
    passed: bool | None  # None: the scorer could not judge the image


@dataclass
class ScoredImage:
    image: GeneratedImage  # the kept try; its request carries the try's index and seed
    scores: dict[str, float] = field(default_factory=dict)  # the kept try's, by scorer name
    gate: GateRecord | None = None
    phash: int | None = None  # the kept image's 64-bit perceptual hash, unsigned (None: it failed)

    def manifest_columns(self, stored_ok: bool) -> dict[str, Any]:
        """Its manifest columns (workers.output.manifest): the score of each scorer (null when not
        stored or NaN: the scorer cannot judge it), phash (null when not stored) and, under a
        gate, gate_*."""
        columns: dict[str, Any] = {
            "scores": {
                name: v if stored_ok and not math.isnan(v) else None for name, v in self.scores.items()
            }
        }
        if stored_ok and self.phash is not None:
            # The manifest's int64 holds the 64 bits: the top bit becomes the sign.
            columns["phash"] = self.phash - (1 << 64) if self.phash >= 1 << 63 else self.phash
        if self.gate is not None:
            columns.update(
                gate_passed=self.gate.passed,
                gate_tries=len(self.gate.scores),
                gate_kept=self.gate.kept,
                gate_scores=json.dumps(list(self.gate.scores)),
                gate_seeds=json.dumps(list(self.gate.seeds)),
            )
        return columns


@dataclass
class _Tries:
    """What the gate keeps of an image between rounds."""

    best: ScoredImage | None = None
    scores: list[float | None] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    generate_s: float = 0.0  # every try's, so the manifest's time is what the image cost

    def record(self, made: ScoredImage, score: float | None) -> None:
        best = self.scores[self.best.image.request.try_index] if self.best is not None else None
        self.scores.append(score)
        self.seeds.append(made.image.request.seed)
        self.generate_s += made.image.generate_s
        if made.image.pixels is not None and score is not None and (best is None or score > best):
            self.best = made  # ties keep the earlier try
        elif self.best is None:
            self.best = made

    def finish(self, passed: bool | None) -> ScoredImage:
        assert self.best is not None
        kept = self.best.image.request.try_index
        self.best.image.generate_s = self.generate_s
        self.best.gate = GateRecord(tuple(self.scores), tuple(self.seeds), kept, passed)
        return self.best


def score_image(image: GeneratedImage, scorers: Sequence[ImageScorer]) -> dict[str, float]:
    """Each scorer's score of the image's stored pixels ({} for a failed image)."""
    if image.pixels is None:
        return {}
    pixels = image.pixels[None]  # (1, 3, H, W) uint8, as stored
    return {s.name: s.score(pixels, [image.request.row.prompt])[0] for s in scorers}


def scored_images(
    generator: BatchGenerator,
    requests: Sequence[ImageRequest],
    batch_size: int,
    scorers: Sequence[ImageScorer],
    gate: GateConfig | None = None,
) -> Iterator[ScoredImage]:
    """The shard's images, each once, scored and hashed, and with a gate its kept try (see the
    module)."""
    for made in _kept_tries(generator, requests, batch_size, scorers, gate):
        if made.image.pixels is not None:
            made.phash = perceptual_hashes(made.image.pixels[None])[0]
        yield made


def _kept_tries(
    generator: BatchGenerator,
    requests: Sequence[ImageRequest],
    batch_size: int,
    scorers: Sequence[ImageScorer],
    gate: GateConfig | None,
) -> Iterator[ScoredImage]:
    """The shard's images, each once, scored, and with a gate its kept try."""
    if gate is not None and gate.scorer not in {s.name for s in scorers}:
        raise ValueError(
            f"quality.gate.scorer {gate.scorer!r} is not among the scorers {[s.name for s in scorers]}"
        )
    tries: dict[tuple[str, int], _Tries] = {}
    todo = list(requests)
    for t in range(gate.max_tries if gate is not None else 1):
        again: list[ImageRequest] = []
        batches = plan_batches(
            [dataclasses.replace(r, try_index=t) for r in todo], batch_size, generator.count_tokens
        )
        for image in iter_generated(generator, batches):
            made = ScoredImage(image, score_image(image, scorers))
            if gate is None:
                yield made
                continue
            req = image.request
            key = (req.row.id, req.k)
            score = made.scores.get(gate.scorer)
            judged = None if score is None or math.isnan(score) else score
            record = tries.setdefault(key, _Tries())
            record.record(made, judged)
            if (image.pixels is None and t == 0) or (score is not None and math.isnan(score)):
                # Generation failed (not a quality question), or the scorer cannot judge it: as made.
                yield record.finish(passed=None)
            elif judged is not None and judged >= gate.min:
                yield record.finish(passed=True)
            elif t + 1 < gate.max_tries:
                again.append(dataclasses.replace(req, try_index=0))
            else:
                yield record.finish(passed=False)
        todo = again
        if not todo:
            return
