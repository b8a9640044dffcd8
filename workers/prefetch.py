"""The next shard, prepared while the current one generates: rows read, inputs fetched, first
batch encoded, so that the GPU does not wait for them between two shards.

The dispatcher announces the run it queued right behind an actor's executing shard
(`driver.dispatch.policy`, `ActorPool.prefetch`); the actor's `prepare_ahead` method runs on a thread
of its own (a Ray concurrency group) and prepares that shard here while `run_shard` generates.
When `run_shard` comes to that shard it takes what was prepared, waiting for it if the
preparation is still under way (the work is half done: redoing it would only be later), instead
of reading the rows itself.

A prefetch is only a head start. What it prepared is what `run_shard` would have prepared (the
same function, `GenerationWorker.prepare_shard`), so images are the same either way. A failed
prefetch is forgotten: `run_shard` prepares the shard again and reports its own error. A shard
announced but never run here (its queued run moved to another actor, cancelled, or this actor
lost) is dropped when a shard announced after it starts, and the dispatcher reassigns it as
any queued run; exactly-once is still the manifest's create-only commit.

Bounded: two prepared shards at most (`ShardPrefetch.HELD`: their rows, their per-shard inputs,
and a batch of prompt embeddings each in the text encoder's bounded cache).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditfleet.workers.generate import ImageRequest
    from ditfleet.workers.rows import PromptRow, ShardSpec


@dataclass
class PreparedShard:
    """What a shard needs before its first batch can run on the device."""

    rows: list[PromptRow]
    requests: list[ImageRequest]
    # Per-shard inputs prepared next to the rows, by name (a job's source images, for one):
    # `GenerationWorker.prepare_inputs` is the hook that fills it; empty for a text-to-image job.
    inputs: dict[str, Any] = field(default_factory=dict)
    prepare_s: float = 0.0  # time the preparation took (reads, fetches, encoding ahead)
    encoded_ahead: int = 0  # prompts of the first batch encoded into the text encoder's cache


class ShardPrefetch:
    """The shards prepared ahead, two at most; see the module docstring.

    Two, because the dispatcher announces shard k+2 as soon as it sees shard k's result, which
    may be before this actor's run_shard took shard k+1 (prepared while k ran): both are still
    wanted then. An older one is dropped when a third is announced, or when a shard announced
    after it starts (it never started here: the dispatcher runs it elsewhere).

    prepare: the shard -> PreparedShard function both paths use (run on the prefetch thread
    here, on run_shard's thread when nothing was prefetched).
    """

    HELD = 2

    def __init__(self, prepare: Callable[[ShardSpec], PreparedShard]) -> None:
        self._prepare = prepare
        self._lock = threading.Lock()
        self._held: OrderedDict[ShardSpec, Future[PreparedShard]] = OrderedDict()  # oldest first
        self._started: ShardSpec | None = None  # the shard run_shard took last
        self.prefetched = 0  # shards prepared here
        self.dropped = 0  # prepared or announced shards that were never taken

    def prefetch(self, shard: ShardSpec) -> bool:
        """Prepare `shard` now (the caller's thread); False when it is held or running already.
        Never raises: a failure is left for run_shard to meet."""
        future: Future[PreparedShard] = Future()
        with self._lock:
            if shard == self._started or shard in self._held:
                return False
            while len(self._held) >= self.HELD:
                self._held.popitem(last=False)
                self.dropped += 1
            self._held[shard] = future
        future.set_running_or_notify_cancel()
        try:
            future.set_result(self._prepare(shard))
            self.prefetched += 1
        except BaseException as e:  # noqa: BLE001 - run_shard prepares it again and raises its own
            future.set_exception(e)
        return True

    def take(self, shard: ShardSpec) -> tuple[PreparedShard, float, bool]:
        """The shard's preparation for run_shard: (prepared, seconds waited for it, prefetched).

        Its prefetch when one was made (waiting for it to finish), else prepared now. Shards
        announced before it are dropped; those announced after it stay (they queue behind it).
        """
        t0 = time.perf_counter()
        future = None
        with self._lock:
            self._started = shard
            if shard in self._held:
                while future is None:
                    older, held = self._held.popitem(last=False)
                    if older == shard:
                        future = held
                    else:
                        self.dropped += 1
        if future is not None:
            try:
                return future.result(), time.perf_counter() - t0, True
            except Exception:  # noqa: BLE001 - prepared again below: the error is raised there
                pass
        return self._prepare(shard), time.perf_counter() - t0, False

    def finished(self, shard: ShardSpec) -> None:
        """run_shard is done with `shard`: a late announcement of it may prepare it again."""
        with self._lock:
            if self._started == shard:
                self._started = None
