"""Batched generation of one shard's images: grouping, seeds, prompt padding, OOM back-off.

A batch shares one resolution bucket, one step count and one CFG on/off decision, so every
tensor shape in it is the same and the compiled shapes of warm-up are the ones used here.
Prompts are padded to their prompt-length bucket, so prompt length never changes a shape either.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from compile import PROMPT_LENGTH_BUCKETS, encode_padded
from model import TextToImagePipeline

from .rows import MAX_SEED, PromptRow


def image_seed(row_seed: int, k: int) -> int:
    """The seed of image k of a row: the row's seed for k = 0 (so one image per row uses exactly
    the row's seed, as any other tool would), a stable hash of (seed, k) for the others."""
    if k == 0:
        return row_seed
    digest = hashlib.blake2b(f"{row_seed}:{k}".encode(), digest_size=8, person=b"ditfleet-k").digest()
    return int.from_bytes(digest, "big") & MAX_SEED


@dataclass(frozen=True)
class ImageRequest:
    row: PromptRow
    k: int

    @property
    def seed(self) -> int:
        return image_seed(self.row.seed, self.k)

    @property
    def uses_cfg(self) -> bool:
        return self.row.true_cfg_scale > 1 and self.row.negative_prompt is not None


@dataclass
class GeneratedImage:
    request: ImageRequest
    pixels: torch.Tensor | None  # (3, H, W) uint8 on the CPU, or None when generation failed
    error: str | None
    generate_s: float  # this image's share of its batch's wall time


def image_requests(rows: Sequence[PromptRow]) -> list[ImageRequest]:
    return [ImageRequest(r, k) for r in rows for k in range(r.num_images)]


def plan_batches(requests: Sequence[ImageRequest], batch_size: int) -> list[list[ImageRequest]]:
    """Group by (bucket, steps, CFG on/off), keep input order inside a group, cut to batch_size.

    Deterministic: the same shard always gives the same batches, so reruns are bit-identical.
    """
    groups: dict[tuple, list[ImageRequest]] = {}
    for req in requests:
        groups.setdefault((req.row.bucket, req.row.steps, req.uses_cfg), []).append(req)
    return [reqs[i : i + batch_size] for reqs in groups.values() for i in range(0, len(reqs), batch_size)]


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class BatchGenerator:
    """Runs batches through the pipeline; a CUDA OOM halves the batch and retries it."""

    def __init__(
        self,
        pipe: TextToImagePipeline,
        max_sequence_length: int = 512,
        prompt_buckets: Sequence[int] = PROMPT_LENGTH_BUCKETS,
    ) -> None:
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length
        self.prompt_buckets = tuple(prompt_buckets)
        self.oom_splits = 0

    def run(self, batch: list[ImageRequest]) -> list[GeneratedImage]:
        """Images of `batch` in its order; an OOM splits the failing part in halves, depth first."""
        out: list[GeneratedImage] = []
        queue = [batch]
        while queue:
            part = queue.pop(0)
            failed = False
            try:
                out += self._run_once(part)
            except Exception as e:  # noqa: BLE001 - an OOM is recoverable, anything else is re-raised
                if not _is_oom(e) or len(part) == 1:
                    raise
                failed = True
            if failed:
                # Retried here, after the except block: inside it the exception's traceback keeps
                # the failed attempt's frames, and every tensor they hold, alive through the retry,
                # and empty_cache could not give their memory back.
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.oom_splits += 1
                half = len(part) // 2
                queue[:0] = [part[:half], part[half:]]
        return out

    def _run_once(self, batch: list[ImageRequest]) -> list[GeneratedImage]:
        t0 = time.perf_counter()
        first = batch[0].row
        rows = [r.row for r in batch]
        scales = [r.true_cfg_scale for r in rows] if batch[0].uses_cfg else 1.0
        # Prompts and negatives padded to prompt-length buckets exactly as warm-up padded them.
        inputs = encode_padded(
            self.pipe,
            [r.prompt for r in rows],
            [r.negative_prompt or " " for r in rows] if batch[0].uses_cfg else None,
            scales,
            self.prompt_buckets,
            self.max_sequence_length,
        )
        images = self.pipe.generate(
            **inputs,
            height=first.height,
            width=first.width,
            steps=first.steps,
            true_cfg_scale=scales,
            seeds=[r.seed for r in batch],
            max_sequence_length=self.max_sequence_length,
        )
        finite = torch.isfinite(images).flatten(1).all(dim=1).tolist()
        pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu()  # (B, 3, H, W)
        share = (time.perf_counter() - t0) / len(batch)
        return [
            GeneratedImage(
                req, pixels[i] if ok else None, None if ok else "non-finite output (NaN or Inf)", share
            )
            for i, (req, ok) in enumerate(zip(batch, finite))
        ]


def iter_generated(generator: BatchGenerator, batches: list[list[ImageRequest]]) -> Iterator[GeneratedImage]:
    """Generated images, batch by batch.

    A batch that raises (other than an OOM that back-off absorbed) raises here: that is a
    shard-level failure, so the shard is retried elsewhere rather than committed with rows
    failed by what may be a passing fault of this actor.
    """
    for batch in batches:
        yield from generator.run(batch)
