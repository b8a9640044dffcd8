"""Batched generation of one shard's images: grouping, seeds, length-sorted batches, OOM back-off.

A batch shares one resolution bucket, one step count, one CFG on/off decision and, in an edit
job, its sources' number and encoded sizes. Inside those groups prompts are sorted by token
length and cut into batches that carry little padding, so most
DiT attention calls run unmasked and the padded rest is a small share of the tokens (the shard
result reports both). Prompts are not padded to prompt-length buckets: a compiled DiT takes the
text length (and batch size) as dynamic dimensions.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image

from ditfleet.model import TextToImagePipeline
from ditfleet.model.family import source_size
from ditfleet.model.generation.guidance import cfg_on, negative_text
from ditfleet.model.generation.pipeline import GuidanceInputs, Sampling
from ditfleet.model.generation.sampling import latent_grid
from ditfleet.workers.rows import MAX_SEED, PromptRow
from ditfleet.workers.source_prefetch import SourceFailed


def _derived_seed(seed: int, index: int, person: bytes) -> int:
    """`seed` itself for index 0, else a stable 63-bit hash of (seed, index) under `person`."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8, person=person).digest()
    return int.from_bytes(digest, "big") & MAX_SEED


def image_seed(row_seed: int, k: int) -> int:
    """The seed of image k of a row: the row's seed for k = 0 (so one image per row uses exactly
    the row's seed, as any other tool would), a stable hash of (seed, k) for the others."""
    return _derived_seed(row_seed, k, b"ditfleet-k")


def try_seed(seed: int, try_index: int) -> int:
    """The seed of try `try_index` of an image whose seed is `seed` (quality.gate): the image's own
    seed for the first try, a stable hash of (seed, try) for the others: a fixed sequence, so the
    same job makes the same tries on any actor and any attempt."""
    return _derived_seed(seed, try_index, b"ditfleet-try")


@dataclass(frozen=True)
class ImageRequest:
    row: PromptRow
    k: int
    try_index: int = 0  # quality.gate: 0 the first try, 1.. the tries after an image under the gate
    index: int = 0  # its place among the shard's requests (image_requests): its manifest row's

    @property
    def seed(self) -> int:
        return try_seed(image_seed(self.row.seed, self.k), self.try_index)

    def source_sizes(self, size_of: SourceSizer = source_size) -> tuple[tuple[int, int], ...]:
        """An edit row's sources as the model encodes them (`size_of` each one's size: the
        pipeline's own, BatchGenerator.source_size; a batch's rows must share them, in number too);
        () for a text row."""
        return tuple(
            size_of(h.width, h.height) if h.width and h.height else (0, 0) for h in self.row.source_headers
        )

    @property
    def uses_cfg(self) -> bool:
        return cfg_on(self.row.true_cfg_scale, has_negative=self.row.negative_prompt is not None)


@dataclass
class GeneratedImage:
    request: ImageRequest
    pixels: torch.Tensor | None  # (3, H, W) uint8 on the CPU, or None when generation failed
    error: str | None
    generate_s: float  # this image's share of its batch's wall time
    # The step cache's record (what the pipeline's Generation says), None when it is off: the
    # settings it ran with (or why it ran exact) and the image's DiT block evaluations, both CFG
    # branches.
    step_cache: str | None = None
    blocks_computed: int | None = None
    blocks_reused: int | None = None


def image_requests(rows: Sequence[PromptRow]) -> list[ImageRequest]:
    """Every image of the rows, in row order, each knowing its place (`index`)."""
    pairs = [(r, k) for r in rows for k in range(r.num_images)]
    return [ImageRequest(r, k, index=i) for i, (r, k) in enumerate(pairs)]


# A batch stops growing when one more prompt would make padding more than this share of the
# tokens its DiT passes compute (image + text, both CFG branches). Padded text costs only its
# linear-layer work (attention skips it), so the share is the compute it wastes.
MAX_PADDED_SHARE = 0.02

TokenCounter = Callable[[list[str]], "list[int] | None"]
# (width, height) of a source -> the size the model encodes it at.
SourceSizer = Callable[[int, int], "tuple[int, int]"]


def plan_batches(
    requests: Sequence[ImageRequest],
    batch_size: int,
    count_tokens: TokenCounter | None = None,
    max_padded_share: float = MAX_PADDED_SHARE,
    source_size_of: SourceSizer = source_size,
) -> list[list[ImageRequest]]:
    """Group by (bucket, steps, CFG on/off, and an edit row's source sizes as the model encodes
    them); inside a group, sort by token length and cut.

    count_tokens: prompt -> embedding length in tokens (the text encoder's tokenizer). Without
    it, input order is kept and batches are cut at batch_size. With it, requests are sorted by
    (negative length, prompt length, input order) and a batch is closed at batch_size or when
    the next request would push its padding past `max_padded_share` of its tokens.
    Deterministic: the same shard always gives the same batches, so reruns are bit-identical.
    """
    groups: dict[tuple, list[ImageRequest]] = {}
    for req in requests:
        key = (req.row.bucket, req.row.steps, req.uses_cfg, req.source_sizes(source_size_of))
        groups.setdefault(key, []).append(req)
    if count_tokens is None:
        return [reqs[i : i + batch_size] for reqs in groups.values() for i in range(0, len(reqs), batch_size)]
    lengths = _token_lengths(requests, count_tokens)
    if lengths is None:
        return plan_batches(requests, batch_size, source_size_of=source_size_of)
    batches: list[list[ImageRequest]] = []
    for reqs in groups.values():
        order = sorted(
            range(len(reqs)), key=lambda i: (lengths[_key(reqs[i])][1], lengths[_key(reqs[i])][0], i)
        )
        batch: list[ImageRequest] = []
        for i in order:
            req = reqs[i]
            if batch and (
                len(batch) >= batch_size or padded_share(batch + [req], lengths) > max_padded_share
            ):
                batches.append(batch)
                batch = []
            batch.append(req)
        if batch:
            batches.append(batch)
    return batches


def _key(req: ImageRequest) -> tuple[str, int]:
    return (req.row.id, req.k)


def _token_lengths(
    requests: Sequence[ImageRequest], count_tokens: TokenCounter
) -> dict[tuple[str, int], tuple[int, int]] | None:
    """(prompt tokens, negative tokens or 0 without CFG) per request; None if uncountable."""
    texts = sorted(set(shard_prompts(requests)))
    counts = count_tokens(texts) if texts else []
    if counts is None:
        return None
    by_text = dict(zip(texts, counts))
    return {
        _key(r): (by_text[r.row.prompt], by_text[negative_text(r.row.negative_prompt)] if r.uses_cfg else 0)
        for r in requests
    }


def shard_prompts(requests: Sequence[ImageRequest]) -> list[str]:
    """Every text a shard's batches will encode: prompts, and negatives where CFG is on."""
    out = [r.row.prompt for r in requests]
    out += [negative_text(r.row.negative_prompt) for r in requests if r.uses_cfg]
    return out


def padded_share(batch: Sequence[ImageRequest], lengths: dict[tuple[str, int], tuple[int, int]]) -> float:
    """Padded text tokens / all tokens of the batch's DiT passes (each branch padded to its longest)."""
    h, w = latent_grid(batch[0].row.height, batch[0].row.width)  # the shared sampler's token grid
    n = h * w
    cond = [lengths[_key(r)][0] for r in batch]
    padded, total = sum(max(cond) - c for c in cond), len(batch) * (n + max(cond))
    if batch[0].uses_cfg:
        neg = [lengths[_key(r)][1] for r in batch]
        padded += sum(max(neg) - c for c in neg)
        total += len(batch) * (n + max(neg))
    return padded / total


class SourceImages(Protocol):
    """An edit shard's source images (workers.source_prefetch.SourcePrefetch): told the order
    rows will be asked for, then asked; `images` raises SourceFailed for a row that cannot be
    edited."""

    def expect(self, rows: Iterable[PromptRow]) -> None: ...

    def images(self, row: PromptRow) -> list[Image.Image]: ...


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class BatchGenerator:
    """Runs batches through the pipeline; a CUDA OOM halves the batch and retries it."""

    def __init__(self, pipe: TextToImagePipeline, max_sources: int | None = None) -> None:
        self.pipe = pipe
        self.max_sequence_length = pipe.settings.max_sequence_length
        self.oom_splits = 0
        # An edit shard's sources (the actor sets them per shard); None: a text job.
        self.sources: SourceImages | None = None
        # The most sources a row may give the model (model.family.model_max_sources; None: any).
        # Validation refuses more before any work where it reads the model; where it could not
        # (an s3:// model), such a row fails here, alone, rather than its shard in the pipeline.
        self.max_sources = max_sources

    def source_size(self, width: int, height: int) -> tuple[int, int]:
        """The size the pipeline encodes a width x height source at: its edit conditioning's (a
        checkpoint may name its own area, as the tiny edit model does), else the family default."""
        edit = getattr(self.pipe, "edit", None)
        return edit.vae_size(width, height) if edit is not None else source_size(width, height)

    def expect(self, batches: Sequence[Sequence[ImageRequest]]) -> None:
        """Tell the sources (if any) the order the batches will ask for rows in."""
        if self.sources is not None:
            self.sources.expect(r.row for batch in batches for r in batch)

    def split_failed(self, batch: list[ImageRequest]) -> tuple[list[ImageRequest], list[GeneratedImage]]:
        """An edit batch's requests whose sources can be used, and a failed image, with the
        reason, for each of the others (a text batch is returned as it is)."""
        if self.sources is None:
            return batch, []
        ok: list[ImageRequest] = []
        failed: list[GeneratedImage] = []
        for req in batch:
            count, most = len(req.row.sources), self.max_sources
            if most is not None and count > most:
                reason = f"{count} source images; the model takes at most {most} per row"
                failed.append(GeneratedImage(req, None, reason, 0.0))
                continue
            try:
                self.sources.images(req.row)
            except SourceFailed as e:
                failed.append(GeneratedImage(req, None, str(e), 0.0))
                continue
            ok.append(req)
        return ok, failed

    def count_tokens(self, prompts: list[str]) -> list[int] | None:
        """Embedding lengths from the text encoder's tokenizer (None: batch in input order)."""
        return self.pipe.count_tokens(prompts, self.max_sequence_length)

    def encode(self, batch: list[ImageRequest]) -> GuidanceInputs:
        """The batch's prompt (and negative) embeddings, on the device, as `generate` takes them."""
        rows = [r.row for r in batch]
        scales = [r.true_cfg_scale for r in rows] if batch[0].uses_cfg else 1.0
        # An edit batch's sources, decoded, one list per prompt (the pipeline encodes them).
        edit = {} if self.sources is None else {"sources": [self.sources.images(r) for r in rows]}
        # Each branch padded only to its longest prompt; a shared negative is encoded once.
        return self.pipe.encode_guidance(
            [r.prompt for r in rows],
            [r.negative_prompt for r in rows] if batch[0].uses_cfg else None,
            scales,
            self.max_sequence_length,
            **edit,
        )

    def run(self, batch: list[ImageRequest], inputs: GuidanceInputs | None = None) -> list[GeneratedImage]:
        """Images of `batch` in its order; an OOM splits the failing part in halves, depth first.
        inputs: the batch's embeddings when already encoded (`encode`, e.g. while the previous
        batch ran); a split part encodes its own."""
        out: list[GeneratedImage] = []
        queue = [batch]
        while queue:
            part = queue.pop(0)
            failed = False
            try:
                out += self._run_once(part, inputs if part is batch else None)
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

    def _run_once(
        self, batch: list[ImageRequest], inputs: GuidanceInputs | None = None
    ) -> list[GeneratedImage]:
        t0 = time.perf_counter()
        first = batch[0].row
        rows = [r.row for r in batch]
        scales = [r.true_cfg_scale for r in rows] if batch[0].uses_cfg else 1.0
        if inputs is None:
            inputs = self.encode(batch)
        sampling = Sampling(first.height, first.width, first.steps, [r.seed for r in batch], scales)
        generation = self.pipe.run(inputs, sampling)
        images, step_cache = generation.images, generation.step_cache
        ok = torch.isfinite(images).flatten(1).all(dim=1)
        pixels = (images * 255).round().clamp(0, 255).to(torch.uint8)  # (B, 3, H, W)
        pixels, ok = to_host(pixels, ok)  # the batch's one blocking wait for the device
        finite = ok.tolist()
        share = (time.perf_counter() - t0) / len(batch)
        out = [
            GeneratedImage(
                req, pixels[i] if ok else None, None if ok else "non-finite output (NaN or Inf)", share
            )
            for i, (req, ok) in enumerate(zip(batch, finite))
        ]
        if step_cache is not None:
            described = step_cache.describe()
            for gen, counts in zip(out, step_cache.per_image()):
                gen.step_cache = described
                gen.blocks_computed, gen.blocks_reused = counts["blocks_computed"], counts["blocks_reused"]
        return out


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Device tensors in host memory with one wait: each copied into pinned memory without
    blocking, then one event waited on. A pageable `.cpu()` per tensor would block once each
    (and stage through a bounce buffer); host tensors come back as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    out = tuple(
        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors
    )
    # Each copy was queued on the current stream of its source tensor's device, which need not
    # be the current device (an actor on cuda:1 of a process whose current device is cuda:0).
    for device in copy_devices(t.device for t in tensors):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return out


def copy_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    """The devices whose streams `to_host`'s copies are queued on, given its tensors' devices:
    each non-CPU one once, in index order."""
    found = {d for d in devices if d.type != "cpu"}
    return sorted(found, key=lambda d: (d.type, -1 if d.index is None else d.index))


def iter_generated(generator: BatchGenerator, batches: list[list[ImageRequest]]) -> Iterator[GeneratedImage]:
    """Generated images, batch by batch; each batch's prompts are encoded on a helper thread while
    the batch before it runs (the text encoder's host work and copies overlap the denoising).

    Encoding is per prompt (workers.text_embeddings), so the embeddings, and the images, are the
    same whichever thread encodes them. A batch that raises (other than an OOM that back-off
    absorbed) raises here: that is a shard-level failure, so the shard is retried elsewhere
    rather than committed with rows failed by what may be a passing fault of this actor.
    """
    if not batches:
        return
    generator.expect(batches)  # an edit shard's sources are read ahead in this order
    stream = encode_stream(torch.device(generator.pipe.device))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-next") as pool:
        pending = pool.submit(_encode, generator, batches[0], stream)
        for i in range(len(batches)):
            batch, failed, inputs, done = pending.result()
            if inputs is not None:
                _use_on_current_stream(inputs, done)
            if i + 1 < len(batches):
                pending = pool.submit(_encode, generator, batches[i + 1], stream)
            yield from failed  # rows whose sources cannot be edited: failed, with the reason
            if batch and inputs is not None:
                yield from generator.run(batch, inputs)


def encode_stream(device: torch.device) -> torch.cuda.Stream | None:
    """On CUDA, a stream of its own for encoding the next batch, so its kernels and copies overlap
    the denoising on the device too, not only on the host; None elsewhere (nothing changes)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _encode(
    generator: BatchGenerator, batch: list[ImageRequest], stream: torch.cuda.Stream | None
) -> tuple[list[ImageRequest], list[GeneratedImage], GuidanceInputs | None, torch.cuda.Event | None]:
    """The batch's requests that can run, the failed images of the others (an edit batch's rows
    whose sources cannot be used: waiting for their fetch happens here, off the device's
    thread) and the runnable ones' embeddings."""
    batch, failed = generator.split_failed(batch)
    if not batch:
        return batch, failed, None, None
    if stream is None:
        return batch, failed, generator.encode(batch), None
    with torch.cuda.stream(stream):
        inputs = generator.encode(batch)
        done = torch.cuda.Event()
        done.record(stream)
    return batch, failed, inputs, done


def _use_on_current_stream(inputs: GuidanceInputs, done: torch.cuda.Event | None) -> None:
    """The denoising stream waits for the encoding stream's work (on the device, not the host),
    and the allocator learns that these tensors are in use there too."""
    if done is None:
        return
    tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    for t in tensors:
        current = torch.cuda.current_stream(t.device)
        current.wait_event(done)
        t.record_stream(current)
