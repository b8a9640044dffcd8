"""Every shard's state and every run in flight: the facts the dispatch policy decides from.

Per-shard counters are parallel arrays, so driver memory stays a few bytes per shard (plus one
result per committed shard).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ditfleet.driver.dispatch.slots import Run
from ditfleet.driver.dispatch.types import ShardFailure

if TYPE_CHECKING:
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec

PENDING, COMMITTED, FAILED = 0, 1, 2


class ShardBook:
    def __init__(self, shards: Sequence[ShardSpec]) -> None:
        self.shards = list(shards)
        n = len(self.shards)
        self.submissions = [0] * n  # runs submitted so far (= the next attempt number)
        self.failures = [0] * n
        self.copies = [0] * n  # runs in flight
        self.status = bytearray(n)  # PENDING | COMMITTED | FAILED
        self.queue: deque[int] = deque(range(n))  # shard positions waiting for an actor
        self.pending = n  # shards not settled
        self.runs: dict[Hashable, Run] = {}  # in-flight ref -> Run
        self.copies_of: dict[int, list[Hashable]] = {}  # shard pos -> its in-flight refs
        self.unstarted: dict[int, int] = {}  # queued shard pos -> attempt number of a run that never started
        self.results: list[ShardResult] = []
        self.failed: list[ShardFailure] = []

    def orphaned(self, pos: int) -> bool:
        """Not settled and no run of it in flight: unless queued again, it would never run."""
        return not self.status[pos] and not self.copies[pos]

    def attempt_for(self, pos: int, reuse: int | None) -> int:
        """reuse: the number of a run that never started (a move); else the next one, from 0."""
        if reuse is not None:
            return reuse
        attempt = self.submissions[pos]
        self.submissions[pos] += 1
        return attempt

    def add(self, ref: Hashable, run: Run) -> None:
        self.runs[ref] = run
        self.copies_of.setdefault(run.pos, []).append(ref)
        self.copies[run.pos] += 1

    def remove(self, ref: Hashable) -> Run | None:
        """Drop a finished (or abandoned) run; None if it was dropped already."""
        run = self.runs.pop(ref, None)
        if run is None:
            return None
        self.copies[run.pos] -= 1
        refs = self.copies_of[run.pos]
        refs.remove(ref)
        if not refs:
            del self.copies_of[run.pos]
        return run

    def requeue_unstarted(self, run: Run) -> None:
        """Back to the front of the queue a run that never started; it keeps its attempt number."""
        self.unstarted[run.pos] = run.attempt
        self.queue.appendleft(run.pos)

    def commit(self, pos: int, result: ShardResult) -> bool:
        """Count the shard's first result; False if it was settled already (a twin's result)."""
        if self.status[pos] != PENDING:
            return False
        self.status[pos] = COMMITTED
        self.pending -= 1
        self.results.append(result)
        return True

    def fail(self, pos: int, kind: str, error: str) -> ShardFailure:
        """Give the shard up."""
        self.status[pos] = FAILED
        self.pending -= 1
        failure = ShardFailure(self.shards[pos].index, self.failures[pos], kind, error)
        self.failed.append(failure)
        return failure
