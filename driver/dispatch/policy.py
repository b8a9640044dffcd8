"""The dispatch policy: which shard runs on which actor, when to retry, duplicate, grow or stop.

It speaks to actors only through an `ActorPool` (driver.dispatch.slots) and reads time from a
clock it is given, so it runs unchanged on a Ray cluster (driver.dispatch.ray_pool) and on a
simulated pool in unit tests. See the package's docstring for what it guarantees.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from ditfleet.driver.dispatch.book import ShardBook
from ditfleet.driver.dispatch.slots import (
    ACTOR_DIED,
    CANCELLED,
    LEAVING,
    ActorPool,
    Run,
    RunError,
    Slot,
    SlotState,
)
from ditfleet.driver.dispatch.types import DispatchError, DispatchResult, DispatchSnapshot, DispatchStats

if TYPE_CHECKING:
    from ditfleet.driver.dispatch.types import DispatchConfig, DispatchEvents
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec

_RECENT_DURATIONS = 256  # shard times kept for the median that the tail decisions use


class Dispatcher:
    """One dispatch of a list of shards; `run()` returns when every shard settled."""

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        pool: ActorPool,
        config: DispatchConfig,
        events: DispatchEvents,
        clock: Callable[[], float] = time.monotonic,
        keep_results: bool = True,
    ):
        self.book = ShardBook(shards, keep_results)
        self.pool = pool
        self.config = config
        self.events = events
        self.clock = clock
        self.starting: dict[Hashable, int] = {}  # startup ref -> slot id
        self.stats = DispatchStats()
        self.durations: deque[float] = deque(maxlen=_RECENT_DURATIONS)
        self.startup_times: deque[float] = deque(maxlen=_RECENT_DURATIONS)
        self.start_failures_in_row = 0
        self.ready_actor_s = 0.0
        self.busy_actor_s = 0.0
        now = clock()
        self.no_ready_since: float | None = now
        self.queue_empty_since: float | None = None if self.book.queue else now
        self._room: dict[int, None] = {}  # ready slot ids that may take another run
        self._retire_at = -math.inf  # no actor can retire before this (while nothing is queued)
        self.startup_actor_s = 0.0  # sum over actors of their time from creation to ready (or gone)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> DispatchResult:
        t0 = self.clock()
        try:
            while self.book.pending:
                self._assign()
                self._scale()
                self._tail()
                self._retire_idle()
                self._enforce_timeouts()
                self._wait_and_handle()
                self.events.tick(self.snapshot())
        finally:
            end = self.clock()
            for slot in list(self.pool.slots.values()):
                self._stop(slot, end)
        return DispatchResult(
            results=self.book.results,
            failed=sorted(self.book.failed, key=lambda f: f.index),
            stats=self.stats,
            wall_s=end - t0,
            ready_actor_s=self.ready_actor_s,
            busy_actor_s=self.busy_actor_s,
            committed=self.book.committed,
            startup_actor_s=self.startup_actor_s,
            gpus_per_actor=self.config.num_gpus,
        )

    def snapshot(self) -> DispatchSnapshot:
        now, book = self.clock(), self.book
        waiting = now - self.no_ready_since if self.no_ready_since is not None and book.queue else 0.0
        starting = [self.pool.slots[i] for i in self.starting.values() if i in self.pool.slots]
        return DispatchSnapshot(
            queued=len(book.queue),
            in_flight=len(book.runs),
            pending_shards=book.pending,
            actors_starting=len(self.starting),
            actors_ready=len(self.pool.ready),
            waiting_for_placement_s=waiting,
            starting_phases=self.pool.phases(starting, now),
        )

    def _wait_and_handle(self) -> None:
        for ref in self.pool.wait([*self.book.runs, *self.starting], self.config.tick_s):
            if ref in self.starting:
                self._handle_startup(ref)
            elif ref in self.book.runs:  # may be gone: dropped with its dead actor earlier in this pass
                self._handle_run(ref)

    # -- actors --------------------------------------------------------------------------------

    def _scale(self) -> None:
        """Start actors while shards wait: up to min at once, up to max while it pays off."""
        queued = len(self.book.queue)
        if not queued:
            return
        cfg, per = self.config, self.config.shards_in_flight_per_actor
        alive = len(self.pool.slots)
        want = max(cfg.min_actors - alive, 0)
        # Shards still queued after _assign wait for an actor; starting actors will take `per` each.
        unserved = queued - per * len(self.starting)
        if unserved > 0 and alive + want < cfg.max_actors and self._growth_pays_off():
            want = max(want, min(cfg.max_actors - alive, math.ceil(unserved / per)))
        want = min(want, queued)  # never more new actors than shards waiting for them
        for _ in range(want):
            slot = self.pool.start(self.clock())
            self.starting[slot.startup_ref] = slot.id
            self.stats.actors_started += 1
        if want:
            self.events.actor_starting(want)
        self._check_placement()

    def _growth_pays_off(self) -> bool:
        """A new actor helps only if the queue outlasts its start-up (load + warm-up)."""
        ready = len(self.pool.ready)
        if not ready or not self.durations or not self.startup_times:
            return True
        drain_s = len(self.book.queue) * statistics.median(self.durations) / ready
        return drain_s > statistics.median(self.startup_times)

    def _check_placement(self) -> None:
        timeout = self.config.placement_timeout_s
        if timeout is None or self.no_ready_since is None or not self.book.queue:
            return
        waited = self.clock() - self.no_ready_since
        if waited > timeout:
            cfg = self.config
            raise DispatchError(
                f"no worker actor became ready in {waited:.0f} s while {len(self.book.queue)} shards "
                f"waited. Each actor asks for {cfg.num_gpus:g} GPU(s), {cfg.num_cpus:g} CPU(s)"
                f"{', ' + str(dict(cfg.resources)) if cfg.resources else ''}; the cluster has "
                f"{self.pool.describe_resources()}. Lower workers.gpus/cpus, add nodes (or an "
                "autoscaler), or raise placement_timeout_s"
            )

    def _handle_startup(self, ref: Hashable) -> None:
        slot = self.pool.slots[self.starting.pop(ref)]
        report = self.pool.startup_outcome(slot)
        if isinstance(report, RunError):
            self._start_failed(slot, report)
            return
        now = self.clock()
        report = dict(report)
        self.pool.mark_ready(slot, report, now)
        self._room[slot.id] = None
        self._retire_at = min(self._retire_at, now + self.config.idle_retire_s)
        startup_s = now - slot.created_at
        report["ready_s"] = startup_s  # as the driver saw it: placement, process start, load, warm-up
        self.startup_times.append(startup_s)
        self.start_failures_in_row = 0
        self.no_ready_since = None
        self.stats.actors_ready += 1
        self.events.actor_ready(slot.worker_id, report, startup_s)

    def _start_failed(self, slot: Slot, error: RunError) -> None:
        """Report the actor that failed to start; it is replaced, unless too many failed in a row."""
        self.stats.start_failures += 1
        self.start_failures_in_row += 1
        self._stop(slot, self.clock())
        self.events.actor_lost(slot.name, error.kind, error.text, True)
        if self.start_failures_in_row >= self._start_failure_limit(error):
            raise DispatchError(
                f"{self.start_failures_in_row} worker actors in a row failed to start; the last "
                f"error: {error.detail or error.text}. Fix the cause (model path, memory, drivers) "
                "and run the same command again: committed shards are kept"
            ) from error.cause

    def _start_failure_limit(self, error: RunError) -> int:
        """Start-ups that may fail in a row before the job stops. An actor whose process or
        node died while starting (a spot node reclaimed) says little about the job: a fleet of
        1,000 starting together loses several that way with nothing wrong, so those are allowed
        up to 5% of the fleet in a row; an actor whose start-up raised is the job's own error."""
        limit = self.config.max_start_failures
        if error.reason == ACTOR_DIED:
            limit = max(limit, math.ceil(0.05 * self.config.max_actors))
        return limit

    def _stop(self, slot: Slot, now: float) -> None:
        if slot.ready_at is not None:
            self.ready_actor_s += now - slot.ready_at
        self.startup_actor_s += (slot.ready_at if slot.ready_at is not None else now) - slot.created_at
        self._room.pop(slot.id, None)
        if slot.startup_ref is not None:
            self.starting.pop(slot.startup_ref, None)
        self.pool.stop(slot)
        if self.no_ready_since is None and not len(self.pool.ready):
            self.no_ready_since = now

    def _lose_actor(self, slot: Slot, kind: str, error: str, blame_head: bool = True) -> None:
        """The actor is dead or must go: stop it and settle every run it held.

        blame_head: the executing run counts as a failed attempt (it died with the actor, and
        may have killed it). Not when the actor is stopped for reasons of its own.
        """
        refs = list(slot.runs)
        self._stop(slot, self.clock())
        for i, ref in enumerate(refs):
            run = self._forget(ref)
            if run is None or run.cancelled:
                continue
            if i == 0 and blame_head:
                self._run_failed(run, kind, error)
            elif self.book.orphaned(run.pos):
                self.book.requeue_unstarted(run)  # only queued behind it: no attempt used

    def _retire_idle(self) -> None:
        now = self.clock()
        if self.book.queue:
            self.queue_empty_since = None
            return
        if self.queue_empty_since is None:
            self.queue_empty_since = now
            self._retire_at = -math.inf
        if now < self._retire_at:
            return  # no actor idle (or pending) long enough yet: skip the scan of every actor
        self._retire_at = math.inf
        for slot in list(self.pool.slots.values()):
            idle_for = (
                now - (slot.idle_since or now) if slot.state is SlotState.READY and not slot.runs else -1.0
            )
            pending_for = now - self.queue_empty_since if slot.state is SlotState.STARTING else -1.0
            waited = max(idle_for, pending_for)
            if waited >= self.config.idle_retire_s:
                # Pending actors too: an actor that waits for a node keeps asking the autoscaler.
                self._stop(slot, now)
                self.stats.actors_retired += 1
                self.events.actor_retired(slot.name)
            elif waited >= 0:  # the earliest time the next scan can retire anyone
                self._retire_at = min(self._retire_at, now + self.config.idle_retire_s - waited)

    def _enforce_timeouts(self) -> None:
        limit = self.config.shard_timeout_s
        if limit is None:
            return
        now = self.clock()
        for slot in list(self.pool.slots.values()):
            head = self.book.runs.get(slot.runs[0]) if slot.runs else None
            if head and head.started_at is not None and now - head.started_at > limit:
                self.stats.actor_deaths += 1
                self.events.actor_lost(slot.worker_id, "shard_timeout", f"shard ran over {limit:g} s", False)
                self._lose_actor(slot, "shard_timeout", f"shard_timeout: ran over {limit:g} s, actor stopped")

    # -- shards --------------------------------------------------------------------------------

    def _assign(self) -> None:
        """Give queued shards to ready actors with room: one each first, then fill to depth.

        In the tail (fewer shards than ready actors) only the first level is filled: a shard
        held back waits for whichever actor frees first instead of behind one busy actor.
        """
        queue = self.book.queue
        if not queue or not self._room:
            return
        per = self.config.shards_in_flight_per_actor
        ready = self.pool.ready
        # Only the ready actors with room (kept up to date as runs come and go), in the order
        # they became ready: a full scan of 1,000 actors per event was the loop's main cost.
        open_slots = [ready[i] for i in self._room if i in ready]
        self._room = {}
        try:
            self._fill(open_slots, per, len(ready))
        finally:
            for slot in open_slots:
                if slot.id in ready and len(slot.runs) < per:
                    self._room[slot.id] = None

    def _fill(self, open_slots: list[Slot], per: int, ready_count: int) -> None:
        queue = self.book.queue
        for depth in range(1, per + 1):
            if depth > 1 and len(queue) < ready_count:
                return
            for slot in open_slots:
                if not queue:
                    return
                if len(slot.runs) < depth:
                    pos = queue.popleft()
                    self._submit(pos, slot, speculative=False, attempt=self.book.unstarted.pop(pos, None))

    def _submit(self, pos: int, slot: Slot, speculative: bool, attempt: int | None = None) -> Run:
        """Queue shard `pos` on `slot` under `attempt` (see ShardBook.attempt_for)."""
        attempt = self.book.attempt_for(pos, attempt)
        now = self.clock()
        shard = self.book.shards[pos]
        ref = self.pool.submit(slot, shard, attempt)
        run = Run(pos, attempt, slot.id, now, now if not slot.runs else None, speculative)
        slot.runs.append(ref)
        slot.idle_since = None
        self.book.add(ref, run)
        self.events.shard_started(shard, run.attempt, slot.worker_id, speculative)
        self._announce_next(slot)
        return run

    def _announce_next(self, slot: Slot) -> None:
        """Let the actor prepare the run queued right behind its executing one (one ahead at
        most: runs further back are announced when they move up). Only a head start: a run
        that never starts there (moved, cancelled, its actor lost) is settled as any queued run."""
        if not self.config.prefetch or len(slot.runs) < 2:
            return
        run = self.book.runs.get(slot.runs[1])
        if run is None or run.prefetched or run.cancelled:
            return
        run.prefetched = True
        self.stats.prefetches += 1
        self.pool.prefetch(slot, self.book.shards[run.pos])

    def _forget(self, ref: Hashable) -> Run | None:
        """Drop a finished (or abandoned) run from every index; the next run on its actor starts."""
        run = self.book.remove(ref)
        if run is None:
            return None
        slot = self.pool.slots.get(run.slot)
        now = self.clock()
        if run.started_at is not None and not run.cancelled:
            self.busy_actor_s += now - run.started_at
        if slot is not None and ref in slot.runs:
            was_head = slot.runs[0] == ref
            slot.runs.remove(ref)
            if was_head and slot.runs:
                nxt = self.book.runs.get(slot.runs[0])
                if nxt is not None and nxt.started_at is None:
                    nxt.started_at = now
            if not slot.runs:
                slot.idle_since = now
                self._retire_at = min(self._retire_at, now + self.config.idle_retire_s)
            if slot.state is SlotState.READY:
                self._room[slot.id] = None
                self._announce_next(slot)
        return run

    def _handle_run(self, ref: Hashable) -> None:
        run = self.book.runs[ref]
        slot = self.pool.slots.get(run.slot)
        outcome = self.pool.run_outcome(ref)
        if isinstance(outcome, RunError):
            self._run_error(ref, run, slot, outcome)
        else:
            self._run_done(ref, run, slot, outcome)

    def _run_error(self, ref: Hashable, run: Run, slot: Slot | None, error: RunError) -> None:
        if error.reason == CANCELLED:
            self._forget(ref)
            if not run.cancelled and self.book.orphaned(run.pos):
                self.book.requeue_unstarted(run)  # cancelled by someone else: run it again, no penalty
        elif slot is None:
            self._forget(ref)  # its actor is gone already; a raised error still counts
            if error.reason != ACTOR_DIED:
                self._run_failed(run, error.kind, error.text)
        elif error.reason == ACTOR_DIED:
            self.stats.actor_deaths += 1
            self.events.actor_lost(slot.worker_id, "actor_died", error.text, False)
            self._lose_actor(slot, "actor_died", error.text)
        elif error.reason == LEAVING:
            # The worker was told to stop (spot reclaim) and gave the shard up uncommitted: not
            # the shard's fault. Requeue it as it was and let the actor go.
            self._forget(ref)
            if self.book.orphaned(run.pos):
                self.book.queue.appendleft(run.pos)
            self.stats.actor_deaths += 1
            self.events.actor_lost(slot.worker_id, "stopping", error.text, False)
            self._lose_actor(slot, "stopping", error.text, blame_head=False)
        else:
            self._forget(ref)
            self._run_failed(run, error.kind, error.text)
            slot.consecutive_failures += 1
            if slot.consecutive_failures >= 2:
                # Two shards in a row failed on this actor: suspect the actor (a broken GPU
                # context, a full disk) rather than the shards, and start a fresh one.
                self.stats.actors_replaced += 1
                self.events.actor_lost(slot.worker_id, "replaced", "2 shards in a row failed on it", False)
                self._lose_actor(slot, "actor_replaced", "actor replaced after failing shards", False)

    def _run_done(self, ref: Hashable, run: Run, slot: Slot | None, result: ShardResult) -> None:
        started = run.started_at
        self._forget(ref)
        if slot is not None:
            slot.consecutive_failures = 0
        # The worker's own time when it reports one; else what the driver saw.
        wall = result.wall_s if result.wall_s > 0 else self.clock() - (started or run.submitted_at)
        self.durations.append(float(wall))
        if not self.book.commit(run.pos, result):
            self.stats.duplicate_results += 1  # the shard already settled: count it once
            return
        if run.speculative:
            self.stats.speculative_wins += 1
        for other in list(self.book.copies_of.get(run.pos, ())):
            twin = self.book.runs[other]
            if twin.started_at is None and not twin.cancelled:
                twin.cancelled = True  # still queued behind another run: it need not run at all
                self.pool.cancel(other)
        self.events.shard_committed(self.book.shards[run.pos], result)

    def _run_failed(self, run: Run, kind: str, error: str) -> None:
        book, pos = self.book, run.pos
        book.failures[pos] += 1
        if book.status[pos] or book.copies[pos]:
            return  # a twin committed already, or is still running: let it decide
        shard = book.shards[pos]
        if book.failures[pos] >= self.config.max_attempts:
            self.events.shard_failed(shard, book.fail(pos, kind, error))
        else:
            self.stats.retries += 1
            book.queue.appendleft(pos)  # to the front: a retry found late would lengthen the tail
            self.events.shard_retry(shard, book.submissions[pos], error)

    def _tail(self) -> None:
        """With nothing queued, give idle actors the runs that would finish last."""
        if not self.config.speculative_tail or self.book.queue:
            return
        idle = [s for s in self.pool.slots.values() if s.state is SlotState.READY and not s.runs]
        if not idle:
            return
        for slot, (kind, ref, run) in zip(idle, self._tail_candidates()):
            # A moved run keeps its attempt number: the queued original is cancelled before it
            # starts (or, if it started meanwhile, each writes under its own attempt token and
            # the first to commit wins; the other's objects are orphans, see workers.output.layout).
            self._submit(run.pos, slot, speculative=kind == 1, attempt=run.attempt if kind == 0 else None)
            if kind == 0:
                self.stats.tail_moves += 1
                run.cancelled = True
                self.pool.cancel(ref)  # if it started meanwhile, it finishes and the first commit wins
            else:
                self.stats.speculative_runs += 1

    def _tail_candidates(self) -> list[tuple[int, Hashable, Run]]:
        """(0, ref, run) for runs queued behind another shard, oldest first, then (1, ref, run)
        for stragglers: single runs going longer than speculative_after x the median shard time."""
        now, book = self.clock(), self.book
        median = statistics.median(self.durations) if self.durations else None
        found: list[tuple[int, float, Hashable, Run]] = []
        for ref, run in book.runs.items():
            if run.cancelled or book.copies[run.pos] != 1 or book.status[run.pos]:
                continue
            if run.started_at is None:
                found.append((0, run.submitted_at, ref, run))
            elif median is not None and now - run.started_at >= self.config.speculative_after * median:
                found.append((1, run.started_at, ref, run))
        found.sort(key=lambda c: (c[0], c[1]))
        return [(kind, ref, run) for kind, _, ref, run in found]
