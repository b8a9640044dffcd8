"""Resolution buckets and prompt-length buckets, defined once for the whole project.

A compiled VAE decode (and DiT) is specialised to the image shapes it has seen. Every image is
therefore generated at one of a few resolution buckets, so the set of shapes is known before the
first request and nothing compiles later. The compiled DiT takes the text length (and the batch
size) as dynamic dimensions, so requests are not padded to prompt-length buckets.

Resolution: a bucket is (width, height) in pixels, both multiples of 16 (8x VAE compression, then
2x2 latent packing). A requested size maps to the bucket with the same size, else to the one with
the nearest aspect ratio, or is refused in strict mode.

Prompt length (kept for comparisons and the shared cache key): embeddings (B, L, D) can be
zero-padded to the smallest bucket length >= L with the padding masked off, which changes no
output (`ditfleet.testing.prompt_padding`, for tests and benchmarks). This module is plain
arithmetic, without torch: the job spec and the driver's planning read it. The default buckets are the model family's (`model.family`):
`default_buckets(model_path)`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ditfleet.model.family import model_family

# 8x VAE downsampling, then 2x2 patch packing of the latent grid.
SIZE_MULTIPLE = 16


class BucketError(ValueError):
    """A size that cannot be mapped to a bucket, or a bucket definition that is invalid."""


@dataclass(frozen=True)
class ResolutionBucket:
    """One supported image size, in pixels. Latent grid is (height/8, width/8), packed 2x2."""

    width: int
    height: int

    def __post_init__(self) -> None:
        for side, value in (("width", self.width), ("height", self.height)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise BucketError(f"bucket {side} must be an int, got {value!r}")
            if value <= 0 or value % SIZE_MULTIPLE:
                lower = value // SIZE_MULTIPLE * SIZE_MULTIPLE
                near = (
                    f"e.g. {lower} or {lower + SIZE_MULTIPLE}" if lower > 0 else f"e.g. {SIZE_MULTIPLE * 8}"
                )
                raise BucketError(
                    f"bucket {side} {value} is not a positive multiple of {SIZE_MULTIPLE} (the VAE "
                    f"downsamples 8x and latents are packed 2x2); use a multiple of {SIZE_MULTIPLE}, {near}"
                )

    @property
    def name(self) -> str:
        """'WxH', e.g. '1664x928'; the form used in job files, manifests and cache keys."""
        return f"{self.width}x{self.height}"

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @classmethod
    def parse(cls, name: str) -> ResolutionBucket:
        """'1328x1328' -> ResolutionBucket(1328, 1328)."""
        parts = str(name).lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise BucketError(f"bucket {name!r} is not of the form 'WIDTHxHEIGHT', e.g. '1328x1328'")
        return cls(int(parts[0]), int(parts[1]))

    def __str__(self) -> str:
        return self.name


# Aspect distances closer than this count as a tie (then the pixel count decides).
_ASPECT_TIE = 1e-9


def _log_aspect(width: int, height: int) -> float:
    # log(w) - log(h) (not log(w / h)) so that swapped sizes give exactly opposite values,
    # and a square request is exactly equidistant from a portrait bucket and its landscape twin.
    return math.log(width) - math.log(height)


@dataclass(frozen=True)
class BucketSet:
    """The resolution buckets of a job. The first bucket is the default.

    strict=False maps a size that is not a bucket to the bucket with the nearest aspect ratio
    (distance |log(w/h) - log(bw/bh)|; on a tie the closer pixel count, then list order).
    strict=True refuses it with a BucketError.
    """

    buckets: tuple[ResolutionBucket, ...]
    strict: bool = False

    def __post_init__(self) -> None:
        buckets = tuple(
            b if isinstance(b, ResolutionBucket) else ResolutionBucket.parse(b) for b in self.buckets
        )
        if not buckets:
            raise BucketError("a bucket set needs at least one bucket, e.g. '1328x1328'")
        names = [b.name for b in buckets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise BucketError(f"bucket(s) {', '.join(repeated)} listed more than once; list each size once")
        object.__setattr__(self, "buckets", buckets)

    @classmethod
    def from_names(cls, names: Iterable[str], strict: bool = False) -> BucketSet:
        """BucketSet.from_names(['1328x1328', '1664x928'])."""
        return cls(tuple(ResolutionBucket.parse(n) for n in names), strict=strict)

    def default(self) -> ResolutionBucket:
        """The bucket of rows that give no size: the first one listed."""
        return self.buckets[0]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buckets)

    def describe(self) -> str:
        """'1328x1328, 1664x928, ...' for error messages."""
        return ", ".join(self.names)

    def __iter__(self) -> Iterator[ResolutionBucket]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def index(self, bucket: ResolutionBucket) -> int:
        return self.buckets.index(bucket)

    def get(self, name: str) -> ResolutionBucket:
        """The bucket called `name` ('WxH'); BucketError if the set has none."""
        for b in self.buckets:
            if b.name == name:
                return b
        raise BucketError(f"bucket {name!r} is not in this job's buckets ({self.describe()})")

    def map(self, width: int, height: int) -> ResolutionBucket:
        """The bucket a requested size (pixels) is generated at. See the class docstring."""
        for side, value in (("width", width), ("height", height)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BucketError(f"requested {side} must be a positive integer, got {value!r}")
        for b in self.buckets:
            if b.width == width and b.height == height:
                return b
        if self.strict:
            raise BucketError(
                f"size {width}x{height} is not one of the job's buckets ({self.describe()}) and bucket "
                "matching is strict; request one of these sizes, or turn strict matching off to map "
                "each size to the bucket with the nearest aspect ratio"
            )
        want = _log_aspect(width, height)
        dists = [abs(want - _log_aspect(b.width, b.height)) for b in self.buckets]
        best = min(dists)
        near = [b for b, d in zip(self.buckets, dists) if d - best <= _ASPECT_TIE]
        pixels = width * height
        # min() keeps the first of equal keys, so list order is the last tie-break.
        return min(near, key=lambda b: abs(math.log(b.pixels / pixels)))


def default_buckets(model: Any, strict: bool = False) -> BucketSet:
    """The buckets a job gets when it lists none: its model family's sizes (`model.family`), the
    first the default size. `model`: a model path as the job names it, or a family."""
    sizes = model_family(model).default_buckets
    return BucketSet(tuple(ResolutionBucket(w, h) for w, h in sizes), strict=strict)


# ---------------------------------------------------------------------------------------------
# Prompt-length buckets

# Short buckets matter when the image has few tokens: a 128x128 image is 64 tokens, and padding a
# 10-token prompt to 64 doubles the DiT's sequence (1.39x the model time of buckets from 16,
# bench/pipeline_profile.py). At Qwen-Image sizes (4096+ image tokens) they cost nothing. Each bucket is one more traced
# text length when the DiT is compiled.
PROMPT_LENGTH_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)


def planned_text_len(n: int) -> int:
    """The prompt length the memory plan sizes for prompts of up to `n` tokens: its prompt-length
    bucket, or `n` itself past the largest (an edit prompt, whose sources' vision tokens are not
    cut at max_sequence_length, may run past it)."""
    return prompt_length_bucket(n) if n <= max(PROMPT_LENGTH_BUCKETS) else n


def prompt_length_bucket(n: int, buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS) -> int:
    """The smallest bucket length >= n tokens; BucketError if n is longer than the largest."""
    if n < 0:
        raise BucketError(f"prompt length must be >= 0 tokens, got {n}")
    for length in sorted(buckets):
        if length >= n:
            return length
    raise BucketError(
        f"prompt is {n} tokens, longer than the largest prompt-length bucket ({max(buckets)} tokens); "
        "shorten the prompt, or add a larger prompt-length bucket"
    )
