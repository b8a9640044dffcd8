"""An edit shard's source images, read whole and decoded off the GPU's path, a bounded amount ahead.

The batch generator announces the order its batches will use the rows in (`expect`); a few
threads fetch and decode each row's sources in that order (workers.sources.SourceReader.fetch:
checked against the identity planned, sha256 taken) while the device works on earlier batches,
and `images(row)` hands them over. What is held (in flight, decoded and waiting, or used and not
yet dropped) is at most `max_bytes`, counted from the headers (stored bytes + 3 bytes a pixel
decoded) before a fetch starts; a row larger than that alone still goes, one at a time. Rows
used are dropped first, least recently used first; a row asked for again after it was dropped
(a second image of the row in a later batch, an OOM-split batch, a quality-gate retry) is read
again: the same bytes, since its identity is checked each time.

A row whose source the header already judged unusable, or that does not decode, fails with its
reason (`SourceFailed`), which its manifest row carries; a source changed since planning
(SourceChanged) or a store that failed after its retries raises to the shard, which is retried.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from PIL import Image

from ditfleet.workers.rows import PromptRow
from ditfleet.workers.sources import SourceHeader, SourceReader

# Bytes of source images an actor holds at most (stored and decoded), and the threads that read
# them: reads mostly wait on storage, decodes release the GIL in Pillow's C code.
PREFETCH_BYTES = 1 << 30
PREFETCH_THREADS = 4


class SourceFailed(ValueError):
    """A row's source cannot be used: the message is the reason its manifest row carries."""


@dataclass
class _Entry:
    future: Future[list[Image.Image] | str]
    cost: int
    used: bool = False


@dataclass
class SourceDigests:
    """Per row (file, row), the sha256 of each source's bytes as read (None: never read)."""

    by_row: dict[tuple[str, int], tuple[str | None, ...]] = field(default_factory=dict)

    def of(self, row: PromptRow) -> tuple[str | None, ...]:
        return self.by_row.get((row.file, row.row), tuple(_embedded_sha(h) for h in row.source_headers))


def _embedded_sha(header: SourceHeader) -> str | None:
    """An embedded source's identity is its sha256: known without reading it again."""
    return header.identity.removeprefix("sha256:") if header.identity.startswith("sha256:") else None


def _key(row: PromptRow) -> tuple[str, int]:
    return (row.file, row.row)


def row_cost(row: PromptRow) -> int:
    """What a row's sources take while held: their stored bytes and their decoded RGB pixels."""
    total = 0
    for h in row.source_headers:
        stored = int(h.identity.split(":", 1)[0]) if h.identity[:1].isdigit() else 0
        total += stored + 3 * (h.width or 0) * (h.height or 0)
    return total


class SourcePrefetch:
    """One shard's sources (see the module); `close` when the shard is over."""

    def __init__(
        self, reader: SourceReader, max_bytes: int = PREFETCH_BYTES, threads: int = PREFETCH_THREADS
    ) -> None:
        self.reader = reader
        self.max_bytes = max_bytes
        self.digests = SourceDigests()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sources")
        self._lock = threading.Lock()
        self._queue: deque[PromptRow] = deque()
        self._queued: set[tuple[str, int]] = set()
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # least recently used first
        self.held = 0  # bytes of the entries held
        self.peak = 0

    def expect(self, rows: Iterable[PromptRow]) -> None:
        """The rows in the order their images will be asked for; each is fetched once ahead."""
        with self._lock:
            for row in rows:
                key = _key(row)
                if row.source_problem is None and key not in self._entries and key not in self._queued:
                    self._queue.append(row)
                    self._queued.add(key)
            self._pump()

    def images(self, row: PromptRow) -> list[Image.Image]:
        """The row's sources, decoded (RGB), in column order; SourceFailed with the reason when
        one cannot be used. Waits for its fetch (starts it now when it was not ahead)."""
        if row.source_problem is not None:
            raise SourceFailed(row.source_problem)
        key = _key(row)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if key in self._queued:
                    self._queue.remove(row)
                    self._queued.discard(key)
                entry = self._start(row)
            self._entries.move_to_end(key)
            entry.used = True
        got = entry.future.result()  # SourceChanged and store failures raise to the shard
        with self._lock:
            self._pump()
        if isinstance(got, str):
            raise SourceFailed(got)
        return got

    def close(self) -> None:
        """Stop fetching: what is queued is dropped, a running fetch ends on its own."""
        with self._lock:
            self._queue.clear()
            self._queued.clear()
            self._entries.clear()
            self.held = 0
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- under the lock ------------------------------------------------------------------------

    def _pump(self) -> None:
        while self._queue:
            cost = row_cost(self._queue[0])
            if self.held and self.held + cost > self.max_bytes and not self._evict_one():
                return
            if self.held and self.held + cost > self.max_bytes:
                continue  # evicted one: look again
            row = self._queue.popleft()
            self._queued.discard(_key(row))
            self._start(row)

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if entry.used and entry.future.done():
                del self._entries[key]
                self.held -= entry.cost
                return True
        return False

    def _start(self, row: PromptRow) -> _Entry:
        entry = _Entry(self._pool.submit(self._fetch, row), row_cost(row))
        self._entries[_key(row)] = entry
        self.held += entry.cost
        self.peak = max(self.peak, self.held)
        return entry

    # -- on the pool's threads -----------------------------------------------------------------

    def _fetch(self, row: PromptRow) -> list[Image.Image] | str:
        images, digests = [], []
        for i, (ref, header) in enumerate(zip(row.sources, row.source_headers)):
            try:
                got = self.reader.fetch(ref, header, i)
            except ValueError as e:  # does not decode: this row fails, with the reason
                return str(e)
            images.append(got.image)
            digests.append(got.sha256)
        self.digests.by_row[_key(row)] = tuple(digests)
        return images
