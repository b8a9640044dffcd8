"""Scores taken where each image is made, and the quality gate that makes an image again when it
scores too low (quality.scorers, quality.gate).

    for made in scored_images(generator, requests, batch_size, scorers, gate):
        made.image, made.scores, made.gate   # the kept try, its scores, every try's record

Every image is scored from the uint8 pixels that will be stored (model.quality: a score depends on
the image and its prompt alone), and the image that comes out gets its perceptual hash, whatever
the job's scorers: the near-duplicate counts of `ditfleet status` and `ditfleet report` read it.

No host work stands between the device's batches. The model-based scorers run on the generator
thread (their models run on the actor's device, which that thread drives). The weight-free ones
and the hash are host work (26-97 ms an image at 1024-1328 px on one core, 2-9% of a few-step
image's DiT time): a weight-free gate scorer scores each try on a thread of its own while the
next batch is made (the gate needs the scores only to plan its next round), and the other
scorers and the hash go with the kept try to the writer's threads (`ScoredImage.host_work`).
Same functions on the same pixels, tries judged in the order made: the same values and the same
images in the same order. Without a gate each image comes out as it is made. With one, the tries go
in rounds: round t makes try t (workers.generate.try_seed) of every image that has not passed yet,
batched like any other work; an image comes out when a try passes (score >= min), when the scorer
cannot judge it (NaN: kept as made), when its generation failed on the first try (a failure is not
a quality question), or after `max_tries` with its best try. Only the kept try's pixels ever leave
this module, so a try that lost is never stored and leaves nothing behind; the rounds, the seeds
and the decisions depend only on the shard's rows, so a rerun of the shard makes the same tries.

Memory: an image under the gate holds its best try's pixels (uint8) until it comes out.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

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


@dataclass(frozen=True, kw_only=True)
class GateRecord:
    """Every try of one image under the gate, in try order, and which one was kept."""

    scores: tuple[float | None, ...]  # the gate's score of each try (None: the try failed or is NaN)
    seeds: tuple[int, ...]
    kept: int
    passed: bool | None  # None: the scorer could not judge the image


def runs_on_host(scorer: ImageScorer) -> bool:
    """A scorer that holds no model (the weight-free ones: sharpness, tiny) is plain CPU work on
    the stored pixels, which any thread can do; a model-based one runs its model on the device."""
    return getattr(scorer, "model", None) is None


@dataclass
class ScoredImage:
    image: GeneratedImage  # the kept try; its request carries the try's index and seed
    scores: dict[str, float] = field(default_factory=dict)  # the kept try's, by scorer name
    gate: GateRecord | None = None
    phash: int | None = None  # the kept image's 64-bit perceptual hash, unsigned (None: it failed)
    # Scored by `host_work`, not on the generator thread (see the module).
    host_scorers: tuple[ImageScorer, ...] = ()

    def host_work(self) -> Callable[[], None]:
        """The image's host work as a call for another thread: the scores of `host_scorers` and
        the pHash, from the pixels it holds now (the caller may drop them after). `scores` and
        `phash` are complete once the call returned; nothing to do for a failed image."""
        pixels, prompt, scorers = self.image.pixels, self.image.request.row.prompt, self.host_scorers

        def run() -> None:
            if pixels is None:
                return
            try:
                self.scores.update(score_pixels(pixels, prompt, scorers))
                self.phash = perceptual_hashes(pixels[None])[0]
            except Exception as e:  # on the writer's thread: say which image and what failed
                req = self.image.request
                names = [s.name for s in scorers] + ["phash"]
                raise RuntimeError(
                    f"scoring image id={req.row.id!r} k={req.k} ({', '.join(names)}) failed: {type(e).__name__}: {e}"
                ) from e

        return run

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
        self.best.gate = GateRecord(
            scores=tuple(self.scores), seeds=tuple(self.seeds), kept=kept, passed=passed
        )
        return self.best


def score_pixels(pixels: torch.Tensor, prompt: str, scorers: Sequence[ImageScorer]) -> dict[str, float]:
    """Each scorer's score of one image's stored pixels ((3, H, W) uint8) and its prompt."""
    return {s.name: s.score(pixels[None], [prompt])[0] for s in scorers}


def scored_images(
    generator: BatchGenerator,
    requests: Sequence[ImageRequest],
    batch_size: int,
    scorers: Sequence[ImageScorer],
    gate: GateConfig | None = None,
) -> Iterator[ScoredImage]:
    """The shard's images, each once, and with a gate its kept try, scored by the model-based
    scorers and the gate's; each one's `host_work` scores the rest and hashes it (see the module)."""
    if gate is not None and gate.scorer not in {s.name for s in scorers}:
        raise ValueError(
            f"quality.gate.scorer {gate.scorer!r} is not among the scorers {[s.name for s in scorers]}"
        )
    later = tuple(s for s in scorers if runs_on_host(s) and (gate is None or s.name != gate.scorer))
    now = [s for s in scorers if s not in later]
    if gate is None:
        batches = plan_batches(
            requests, batch_size, generator.count_tokens, source_size_of=generator.source_size
        )
        made: Iterator[ScoredImage] = (
            ScoredImage(i, _scores(i, now)) for i in iter_generated(generator, batches)
        )
    else:
        made = _kept_tries(generator, requests, batch_size, now, gate)
    for image in made:
        image.host_scorers = later
        yield image


def _scores(image: GeneratedImage, scorers: Sequence[ImageScorer]) -> dict[str, float]:
    """The scorers' scores of a made image ({} for a failed one)."""
    return {} if image.pixels is None else score_pixels(image.pixels, image.request.row.prompt, scorers)


def _kept_tries(
    generator: BatchGenerator,
    requests: Sequence[ImageRequest],
    batch_size: int,
    scorers: Sequence[ImageScorer],
    gate: GateConfig,
) -> Iterator[ScoredImage]:
    """Each image's kept try, scored by `scorers`, in rounds (see the module).

    A round's retries are planned when the round is over, so an image's gate score is not needed
    before then: a weight-free gate scorer scores each try on a thread of its own while the
    device makes the next batch, and the tries are judged in the order they were made, as soon
    as their score is in (the images come out in the same order as if scored here)."""
    judge = [s for s in scorers if s.name == gate.scorer]
    now = [s for s in scorers if s.name != gate.scorer or not runs_on_host(s)]
    judged_later = [s for s in judge if s not in now]
    tries: dict[tuple[str, int], _Tries] = {}
    todo = list(requests)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gate-score") as pool:
        for t in range(gate.max_tries):
            again: list[ImageRequest] = []
            waiting: collections.deque[tuple[ScoredImage, Future[dict[str, float]]]] = collections.deque()
            batches = plan_batches(
                [dataclasses.replace(r, try_index=t) for r in todo],
                batch_size,
                generator.count_tokens,
                source_size_of=generator.source_size,
            )
            for image in iter_generated(generator, batches):
                waiting.append(
                    (ScoredImage(image, _scores(image, now)), pool.submit(_scores, image, judged_later))
                )
                while waiting and waiting[0][1].done():
                    yield from _judge(*waiting.popleft(), tries, t, gate, again)
            while waiting:  # the round's last scores: the next round is planned from them
                yield from _judge(*waiting.popleft(), tries, t, gate, again)
            todo = again
            if not todo:
                return


def _judge(
    made: ScoredImage,
    scoring: Future[dict[str, float]],
    tries: dict[tuple[str, int], _Tries],
    t: int,
    gate: GateConfig,
    again: list[ImageRequest],
) -> Iterator[ScoredImage]:
    """Record try `t` of an image and yield its kept try when it is decided; else it goes `again`."""
    made.scores.update(scoring.result())
    image = made.image
    req = image.request
    score = made.scores.get(gate.scorer)
    judged = None if score is None or math.isnan(score) else score
    record = tries.setdefault((req.row.id, req.k), _Tries())
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
