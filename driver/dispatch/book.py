"""Every shard's state and every run in flight: the facts the dispatch policy decides from.

Per-shard counters are parallel typed arrays, so the book holds a few bytes per shard: the queue
(a cursor, plus the shards put back), the counters (7 bytes) and the status (1); the shards themselves are the
plan's. A committed shard's result is kept only when asked (keep_results), so a 400,000-shard
dispatch holds none.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ditfleet.driver.dispatch.slots import Run
from ditfleet.driver.dispatch.types import ShardFailure

if TYPE_CHECKING:
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec

PENDING, COMMITTED, FAILED = 0, 1, 2


class ShardQueue:
    """The shard positions waiting for an actor: 0..n-1 in order, behind any put back in front.

    The untouched positions are a cursor, not n int objects (36 bytes each in a deque); only
    the shards put back (retries, moves) are held.
    """

    def __init__(self, n: int) -> None:
        self._front: deque[int] = deque()
        self._next, self._n = 0, n

    def __len__(self) -> int:
        return len(self._front) + self._n - self._next

    def popleft(self) -> int:
        if self._front:
            return self._front.popleft()
        if self._next >= self._n:
            raise IndexError("pop from an empty shard queue")
        self._next += 1
        return self._next - 1

    def appendleft(self, pos: int) -> None:
        self._front.appendleft(pos)


class ShardBook:
    def __init__(self, shards: Sequence[ShardSpec], keep_results: bool = True) -> None:
        self.shards = shards if isinstance(shards, (list, tuple)) else list(shards)
        n = len(self.shards)
        # Small counters in typed arrays: 4 + 2 + 1 bytes a shard instead of 8 a list slot.
        self.submissions = array("i", bytes(4 * n))  # runs submitted so far (= the next attempt number)
        self.failures = array("H", bytes(2 * n))  # failed runs (max_attempts is at most 100)
        self.copies = array("B", bytes(n))  # runs in flight (1, or 2 with a speculative twin)
        self.status = bytearray(n)  # PENDING | COMMITTED | FAILED
        self.keep_results = keep_results
        self.committed = 0
        self.queue = ShardQueue(n)  # shard positions waiting for an actor
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
        self.committed += 1
        if self.keep_results:
            self.results.append(result)
        return True

    def fail(self, pos: int, kind: str, error: str) -> ShardFailure:
        self.status[pos] = FAILED
        self.pending -= 1
        failure = ShardFailure(self.shards[pos].index, self.failures[pos], kind, error)
        self.failed.append(failure)
        return failure
