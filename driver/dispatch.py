"""Dispatch: feed shards to an elastic pool of worker actors until each is committed or failed.

Pull, not a static split: an actor gets a shard when it has room, so an actor that joins late
or runs fast simply does more. Each ready actor holds up to `shards_in_flight_per_actor` runs
(one executing, the rest queued on the actor) so its GPU never waits for a round trip.

Failures: a shard whose run raises, or whose actor dies, goes back to the front of the queue;
after `max_attempts` failed runs it is reported failed and the job goes on. A dead actor is
replaced while shards wait. Runs that were only queued behind the failed one on a dead actor go
back without using up an attempt.

Tail: when the queue is empty and actors sit idle, shards queued behind another one on a busy
actor move to an idle actor (the queued call is cancelled), and shards that have run much longer
than the median get a second, speculative run. The first commit wins: the worker's create-only
manifest write guarantees at most one manifest per shard, and only the first result is counted.
Each run writes its objects under its own attempt token, so a twin never touches what the
winner's manifest names. When the last shard settled, every actor is killed and `run_shards`
waits until their processes are gone (driver.fence) before it returns.

Cost per event is O(actors + in-flight runs); driver memory is O(shards) (a few ints per shard
and one result per committed shard).
"""

from __future__ import annotations

# Ray is imported inside the functions that use it: `ditfleet validate` and `plan` import this
# module (for its types) and must not pay for loading Ray.
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.actor_phases import ActorPhase, PhaseTracker, actor_id
from driver.fence import wait_actors_gone
from driver.pool import ActorPool, Run, Slot, SlotState, error_kind, short_error
from workers.startup_phase import forget_phase

_PENDING, _COMMITTED, _FAILED = 0, 1, 2
# Exceptions (by type name, as they cross process boundaries) with which a worker says it is
# leaving (asked to stop) rather than that the shard failed: workers.actor.ShardAbandoned.
LEAVING_ERRORS = frozenset({"ShardAbandoned"})
_RECENT_DURATIONS = 256  # shard times kept for the median that the tail decisions use


class DispatchError(RuntimeError):
    """The job cannot go on: actors keep failing to start, or none can be placed."""


@dataclass(frozen=True)
class DispatchConfig:
    """How many actors, with what resources, and how shards are retried and duplicated."""

    min_actors: int = 1  # started at once, and kept while shards wait
    max_actors: int = 1  # grown to while shards wait; actors Ray cannot place yet just pend
    num_gpus: float = 0.0  # per actor
    num_cpus: float = 1.0  # per actor
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources per actor
    shards_in_flight_per_actor: int = 2  # 1 running + queued ones, so the GPU never waits
    max_attempts: int = 3  # failed runs of one shard before it is reported failed
    speculative_tail: bool = True  # move/duplicate tail shards onto idle actors
    speculative_after: float = 1.5  # a running shard is duplicated after this x the median shard time
    idle_retire_s: float = 10.0  # an actor idle this long with an empty queue is stopped
    shard_timeout_s: float | None = None  # a run longer than this kills its actor (None: no limit)
    placement_timeout_s: float | None = 1800.0  # no actor ready for this long while shards wait: stop
    max_start_failures: int = 3  # actors failing to start in a row (none ready between): stop
    tick_s: float = 0.5  # longest wait between checks of timers (retirement, tail, progress)
    # After the last shard settled, wait this long at most for every actor's process to be gone
    # (driver.fence), so that no run can still write when the driver writes _SUCCESS.
    fence_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        checks = [
            (self.min_actors >= 1, "min_actors must be >= 1"),
            (self.max_actors >= self.min_actors, "max_actors must be >= min_actors"),
            (self.num_gpus >= 0 and self.num_cpus >= 0, "num_gpus and num_cpus must be >= 0"),
            (self.shards_in_flight_per_actor >= 1, "shards_in_flight_per_actor must be >= 1"),
            (self.max_attempts >= 1, "max_attempts must be >= 1"),
            (self.speculative_after > 0, "speculative_after must be > 0"),
            (self.idle_retire_s >= 0, "idle_retire_s must be >= 0"),
            (self.shard_timeout_s is None or self.shard_timeout_s > 0, "shard_timeout_s must be > 0"),
            (
                self.placement_timeout_s is None or self.placement_timeout_s > 0,
                "placement_timeout_s must be > 0",
            ),
            (self.max_start_failures >= 1, "max_start_failures must be >= 1"),
            (self.tick_s > 0, "tick_s must be > 0"),
            (self.fence_timeout_s >= 0, "fence_timeout_s must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DispatchConfig: {message} (got {self!r})")


@dataclass(frozen=True)
class ShardFailure:
    """A shard given up after max_attempts failed runs."""

    index: int
    attempts: int  # failed runs (= max_attempts)
    kind: str  # 'actor_died' or the exception type raised by run_shard
    error: str  # the last error, one line


@dataclass
class DispatchStats:
    actors_started: int = 0
    actors_ready: int = 0
    actor_deaths: int = 0  # died while ready (crash, kill, node loss, shard timeout)
    start_failures: int = 0  # died before becoming ready
    actors_replaced: int = 0  # stopped after failing shards in a row
    actors_retired: int = 0  # stopped because idle with nothing queued
    retries: int = 0  # runs requeued after a failure
    tail_moves: int = 0  # queued runs moved to an idle actor
    speculative_runs: int = 0  # second runs of slow shards
    speculative_wins: int = 0  # shards whose speculative run committed first
    duplicate_results: int = 0  # results of a shard already committed (counted once)


@dataclass
class DispatchResult:
    results: list[Any]  # the first ShardResult of each committed shard
    failed: list[ShardFailure]
    stats: DispatchStats
    startup_reports: list[dict]
    wall_s: float  # from the first actor started to the last shard settled
    ready_actor_s: float  # sum over actors of the time they were ready (until the end)
    busy_actor_s: float  # sum of shard run times (executing, duplicates included)
    unfenced_actors: list[str] = field(default_factory=list)  # actor ids whose process outlived the fence wait


@dataclass(frozen=True)
class DispatchSnapshot:
    """What the dispatcher is doing now, for progress displays."""

    queued: int
    in_flight: int
    pending_shards: int
    actors_starting: int
    actors_ready: int
    waiting_for_placement_s: float  # how long shards have waited with no actor ready (0 if one is)
    # Each starting actor's phase: waiting for resources / unplaceable (Ray), loading, compiling
    # bucket i of n, ready (the actor's own report); see driver.actor_phases.
    starting_phases: tuple[ActorPhase, ...] = ()


class DispatchEvents:
    """Callbacks from the dispatch loop (all no-ops here); `driver.progress` implements them.

    They run on the driver's loop thread: keep them short.
    """

    def actor_starting(self, count: int) -> None: ...

    def actor_ready(self, worker_id: str, report: dict, startup_s: float) -> None: ...

    def actor_lost(self, worker_id: str, kind: str, error: str, starting: bool) -> None: ...

    def actor_retired(self, worker_id: str) -> None: ...

    def shard_started(self, shard: Any, attempt: int, worker_id: str, speculative: bool) -> None: ...

    def shard_committed(self, shard: Any, result: Any) -> None: ...

    def shard_retry(self, shard: Any, attempt: int, error: str) -> None: ...

    def shard_failed(self, shard: Any, failure: ShardFailure) -> None: ...

    def tick(self, snapshot: DispatchSnapshot) -> None: ...


@dataclass
class _ShardState:
    """Per-shard counters, as parallel arrays so that memory stays a few bytes per shard."""

    n: int
    submissions: list[int] = field(init=False)  # runs submitted so far (= the next attempt number)
    failures: list[int] = field(init=False)
    copies: list[int] = field(init=False)  # runs in flight
    status: bytearray = field(init=False)

    def __post_init__(self) -> None:
        self.submissions = [0] * self.n
        self.failures = [0] * self.n
        self.copies = [0] * self.n
        self.status = bytearray(self.n)


class Dispatcher:
    """One dispatch of a list of shards; `run()` returns when every shard settled."""

    def __init__(
        self, shards: Sequence[Any], pool: ActorPool, config: DispatchConfig, events: DispatchEvents
    ):
        self.shards = list(shards)
        self.pool = pool
        self.config = config
        self.events = events
        self.state = _ShardState(len(self.shards))
        self.queue: deque[int] = deque(range(len(self.shards)))
        self.pending = len(self.shards)
        self.runs: dict[Any, Run] = {}  # in-flight ObjectRef -> Run
        self.copies_of: dict[int, list[Any]] = {}  # shard pos -> its in-flight refs
        self.starting: dict[Any, int] = {}  # startup ObjectRef -> slot id
        self.unstarted: dict[int, int] = {}  # queued shard pos -> attempt number of a run that never started
        self.results: list[Any] = []
        self.failed: list[ShardFailure] = []
        self.stats = DispatchStats()
        self.startup_reports: list[dict] = []
        self.durations: deque[float] = deque(maxlen=_RECENT_DURATIONS)
        self.startup_times: deque[float] = deque(maxlen=_RECENT_DURATIONS)
        self.start_failures_in_row = 0
        self.ready_actor_s = 0.0
        self.busy_actor_s = 0.0
        request = {"CPU": config.num_cpus, "GPU": config.num_gpus, **dict(config.resources)}
        self.phases = PhaseTracker(request)
        now = time.monotonic()
        self.no_ready_since: float | None = now
        self.queue_empty_since: float | None = None if self.queue else now

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> DispatchResult:
        t0 = time.monotonic()
        try:
            while self.pending:
                self._assign()
                self._scale()
                self._tail()
                self._retire_idle()
                self._enforce_timeouts()
                self._wait_and_handle()
                self.events.tick(self.snapshot())
        finally:
            end = time.monotonic()
            for slot in list(self.pool.slots.values()):
                self._stop(slot, end)
        return DispatchResult(
            results=self.results,
            failed=sorted(self.failed, key=lambda f: f.index),
            stats=self.stats,
            startup_reports=self.startup_reports,
            wall_s=end - t0,
            ready_actor_s=self.ready_actor_s,
            busy_actor_s=self.busy_actor_s,
        )

    def snapshot(self) -> DispatchSnapshot:
        now = time.monotonic()
        waiting = now - self.no_ready_since if self.no_ready_since is not None and self.queue else 0.0
        return DispatchSnapshot(
            queued=len(self.queue),
            in_flight=len(self.runs),
            pending_shards=self.pending,
            actors_starting=len(self.starting),
            actors_ready=self.pool.count(SlotState.READY),
            waiting_for_placement_s=waiting,
            starting_phases=self.phases.poll(
                [self.pool.slots[i] for i in self.starting.values() if i in self.pool.slots], now
            ),
        )

    def _wait_and_handle(self) -> None:
        import ray
        refs = [*self.runs, *self.starting]
        if not refs:
            time.sleep(min(self.config.tick_s, 0.05))  # nothing in flight: _scale starts actors next turn
            return
        ready, rest = ray.wait(refs, num_returns=1, timeout=self.config.tick_s)
        if ready and rest:
            # Settle everything that is already done in one pass: fewer loop turns under load.
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            if ref in self.starting:
                self._handle_startup(ref)
            elif ref in self.runs:  # may be gone: dropped with its dead actor earlier in this pass
                self._handle_run(ref)

    # -- actors --------------------------------------------------------------------------------

    def _scale(self) -> None:
        """Start actors while shards wait: up to min at once, up to max while it pays off."""
        if not self.queue:
            return
        cfg, per = self.config, self.config.shards_in_flight_per_actor
        alive = len(self.pool.slots)
        want = max(cfg.min_actors - alive, 0)
        # Shards still queued after _assign wait for an actor; starting actors will take `per` each.
        unserved = len(self.queue) - per * len(self.starting)
        if unserved > 0 and alive + want < cfg.max_actors and self._growth_pays_off():
            want = max(want, min(cfg.max_actors - alive, math.ceil(unserved / per)))
        want = min(want, len(self.queue))  # never more new actors than shards waiting for them
        for _ in range(want):
            slot = self.pool.start()
            self.starting[slot.startup_ref] = slot.id
            self.stats.actors_started += 1
        if want:
            self.events.actor_starting(want)
        self._check_placement()

    def _growth_pays_off(self) -> bool:
        """A new actor helps only if the queue outlasts its start-up (load + warm-up)."""
        ready = self.pool.count(SlotState.READY)
        if not ready or not self.durations or not self.startup_times:
            return True
        drain_s = len(self.queue) * statistics.median(self.durations) / ready
        return drain_s > statistics.median(self.startup_times)

    def _check_placement(self) -> None:
        timeout = self.config.placement_timeout_s
        if timeout is None or self.no_ready_since is None or not self.queue:
            return
        waited = time.monotonic() - self.no_ready_since
        if waited > timeout:
            cfg = self.config
            raise DispatchError(
                f"no worker actor became ready in {waited:.0f} s while {len(self.queue)} shards waited. "
                f"Each actor asks for {cfg.num_gpus:g} GPU(s), {cfg.num_cpus:g} CPU(s)"
                f"{', ' + str(dict(cfg.resources)) if cfg.resources else ''}; the cluster has "
                f"{_cluster_resources()}. Lower workers.gpus/cpus, add nodes (or an autoscaler), "
                "or raise placement_timeout_s"
            )

    def _handle_startup(self, ref: Any) -> None:
        import ray
        slot = self.pool.slots[self.starting.pop(ref)]
        forget_phase(actor_id(slot.handle))
        try:
            report = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - any start failure is reported, then replaced
            self.stats.start_failures += 1
            self.start_failures_in_row += 1
            self._stop(slot, time.monotonic())
            self.events.actor_lost(f"actor-{slot.id}", error_kind(e), short_error(e), True)
            if self.start_failures_in_row >= self.config.max_start_failures:
                raise DispatchError(
                    f"{self.start_failures_in_row} worker actors in a row failed to start; the last "
                    f"error: {short_error(e, limit=2000)}. Fix the cause (model path, memory, "
                    "drivers) and run the same command again: committed shards are kept"
                ) from e
            return
        report = dict(report or {})
        self.pool.mark_ready(slot, report)
        startup_s = slot.ready_at - slot.created_at  # type: ignore[operator]
        report["ready_s"] = startup_s  # as the driver saw it: placement, process start, load, warm-up
        self.startup_reports.append(report)
        self.startup_times.append(startup_s)
        self.start_failures_in_row = 0
        self.no_ready_since = None
        self.stats.actors_ready += 1
        self.events.actor_ready(slot.worker_id, report, startup_s)

    def _stop(self, slot: Slot, now: float) -> None:
        if slot.ready_at is not None:
            self.ready_actor_s += now - slot.ready_at
        if slot.startup_ref is not None:
            self.starting.pop(slot.startup_ref, None)
            forget_phase(actor_id(slot.handle))
        self.pool.stop(slot)
        if self.no_ready_since is None and not self.pool.count(SlotState.READY):
            self.no_ready_since = now

    def _lose_actor(self, slot: Slot, error: BaseException | str, kind: str, blame_head: bool = True) -> None:
        """The actor is dead or must go: stop it and settle every run it held.

        blame_head: the executing run counts as a failed attempt (it died with the actor, and
        may have killed it). Not when the actor is stopped for reasons of its own.
        """
        text = error if isinstance(error, str) else short_error(error)
        refs = list(slot.runs)
        self._stop(slot, time.monotonic())
        for i, ref in enumerate(refs):
            run = self._forget(ref)
            if run is None or run.cancelled:
                continue
            if i == 0 and blame_head:
                self._run_failed(run, kind, text)
            elif not self.state.status[run.pos] and not self.state.copies[run.pos]:
                self._requeue_unstarted(run)  # only queued behind it: no attempt used

    def _retire_idle(self) -> None:
        now = time.monotonic()
        if self.queue:
            self.queue_empty_since = None
            return
        if self.queue_empty_since is None:
            self.queue_empty_since = now
        for slot in list(self.pool.slots.values()):
            idle_for = (
                now - (slot.idle_since or now) if slot.state is SlotState.READY and not slot.runs else -1.0
            )
            pending_for = now - self.queue_empty_since if slot.state is SlotState.STARTING else -1.0
            if max(idle_for, pending_for) >= self.config.idle_retire_s:
                # Pending actors too: an actor that waits for a node keeps asking the autoscaler.
                self._stop(slot, now)
                self.stats.actors_retired += 1
                self.events.actor_retired(slot.worker_id or f"actor-{slot.id}")

    def _enforce_timeouts(self) -> None:
        limit = self.config.shard_timeout_s
        if limit is None:
            return
        now = time.monotonic()
        for slot in list(self.pool.slots.values()):
            head = self.runs.get(slot.runs[0]) if slot.runs else None
            if head and head.started_at is not None and now - head.started_at > limit:
                self.stats.actor_deaths += 1
                self.events.actor_lost(slot.worker_id, "shard_timeout", f"shard ran over {limit:g} s", False)
                self._lose_actor(slot, f"shard_timeout: ran over {limit:g} s, actor stopped", "shard_timeout")

    # -- shards --------------------------------------------------------------------------------

    def _assign(self) -> None:
        """Give queued shards to ready actors with room: one each first, then fill to depth.

        In the tail (fewer shards than ready actors) only the first level is filled: a shard
        held back waits for whichever actor frees first instead of behind one busy actor.
        """
        if not self.queue:
            return
        ready = [s for s in self.pool.slots.values() if s.state is SlotState.READY]
        for depth in range(1, self.config.shards_in_flight_per_actor + 1):
            if depth > 1 and len(self.queue) < len(ready):
                return
            for slot in ready:
                if not self.queue:
                    return
                if len(slot.runs) < depth:
                    pos = self.queue.popleft()
                    self._submit(pos, slot, speculative=False, attempt=self.unstarted.pop(pos, None))

    def _submit(self, pos: int, slot: Slot, speculative: bool, attempt: int | None = None) -> Run:
        """Queue shard `pos` on `slot`. attempt: reuse a number (a move of a run that never
        started); default the next one, from 0, as the manifest records it."""
        st = self.state
        if attempt is None:
            attempt = st.submissions[pos]
            st.submissions[pos] += 1
        now = time.monotonic()
        ref = slot.handle.run_shard.remote(self.shards[pos], attempt)
        run = Run(pos, attempt, slot.id, now, now if not slot.runs else None, speculative)
        slot.runs.append(ref)
        slot.idle_since = None
        self.runs[ref] = run
        self.copies_of.setdefault(pos, []).append(ref)
        st.copies[pos] += 1
        self.events.shard_started(self.shards[pos], run.attempt, slot.worker_id, speculative)
        return run

    def _requeue_unstarted(self, run: Run) -> None:
        """Back to the front of the queue a run that never started; it keeps its attempt number."""
        self.unstarted[run.pos] = run.attempt
        self.queue.appendleft(run.pos)

    def _forget(self, ref: Any) -> Run | None:
        """Drop a finished (or abandoned) run from every index; the next run on its actor starts."""
        run = self.runs.pop(ref, None)
        if run is None:
            return None
        self.state.copies[run.pos] -= 1
        refs = self.copies_of[run.pos]
        refs.remove(ref)
        if not refs:
            del self.copies_of[run.pos]
        slot = self.pool.slots.get(run.slot)
        now = time.monotonic()
        if run.started_at is not None and not run.cancelled:
            self.busy_actor_s += now - run.started_at
        if slot is not None and ref in slot.runs:
            was_head = slot.runs[0] == ref
            slot.runs.remove(ref)
            if was_head and slot.runs:
                nxt = self.runs.get(slot.runs[0])
                if nxt is not None and nxt.started_at is None:
                    nxt.started_at = now
            if not slot.runs:
                slot.idle_since = now
        return run

    def _handle_run(self, ref: Any) -> None:
        import ray
        run = self.runs[ref]
        slot = self.pool.slots.get(run.slot)
        try:
            result = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            self._forget(ref)
            if not run.cancelled and not self.state.status[run.pos] and not self.state.copies[run.pos]:
                self._requeue_unstarted(run)  # cancelled by someone else: run it again, no penalty
            return
        except ray.exceptions.RayActorError as e:
            if slot is None:
                self._forget(ref)
                return
            self.stats.actor_deaths += 1
            self.events.actor_lost(slot.worker_id, "actor_died", short_error(e), False)
            self._lose_actor(slot, e, "actor_died")
            return
        except Exception as e:  # noqa: BLE001 - run_shard raised: a failed run of this shard
            self._forget(ref)
            if error_kind(e) in LEAVING_ERRORS and slot is not None:
                # The worker was told to stop (spot reclaim) and gave the shard up uncommitted:
                # not the shard's fault. Requeue it as it was and let the actor go.
                if not self.state.status[run.pos] and not self.state.copies[run.pos]:
                    self.queue.appendleft(run.pos)
                self.stats.actor_deaths += 1
                self.events.actor_lost(slot.worker_id, "stopping", short_error(e), False)
                self._lose_actor(slot, e, "stopping", blame_head=False)
                return
            self._run_failed(run, error_kind(e), short_error(e))
            if slot is not None:
                slot.consecutive_failures += 1
                if slot.consecutive_failures >= 2:
                    # Two shards in a row failed on this actor: suspect the actor (a broken GPU
                    # context, a full disk) rather than the shards, and start a fresh one.
                    self.stats.actors_replaced += 1
                    self.events.actor_lost(
                        slot.worker_id, "replaced", "2 shards in a row failed on it", False
                    )
                    self._lose_actor(slot, "actor replaced after failing shards", "actor_replaced", False)
            return
        started = run.started_at
        self._forget(ref)
        if slot is not None:
            slot.consecutive_failures = 0
        wall = getattr(result, "wall_s", None)
        if not isinstance(wall, (int, float)) or wall <= 0:
            wall = time.monotonic() - (started or run.submitted_at)
        self.durations.append(float(wall))
        if self.state.status[run.pos] != _PENDING:
            self.stats.duplicate_results += 1  # the shard already settled: count it once
            return
        self.state.status[run.pos] = _COMMITTED
        self.pending -= 1
        self.results.append(result)
        if run.speculative:
            self.stats.speculative_wins += 1
        for other in list(self.copies_of.get(run.pos, ())):
            twin = self.runs[other]
            if twin.started_at is None and not twin.cancelled:
                twin.cancelled = True  # still queued behind another run: it need not run at all
                ray.cancel(other)
        self.events.shard_committed(self.shards[run.pos], result)

    def _run_failed(self, run: Run, kind: str, error: str) -> None:
        st, pos = self.state, run.pos
        st.failures[pos] += 1
        if st.status[pos] != _PENDING or st.copies[pos]:
            return  # a twin committed already, or is still running: let it decide
        if st.failures[pos] >= self.config.max_attempts:
            st.status[pos] = _FAILED
            self.pending -= 1
            failure = ShardFailure(_index(self.shards[pos], pos), st.failures[pos], kind, error)
            self.failed.append(failure)
            self.events.shard_failed(self.shards[pos], failure)
        else:
            self.stats.retries += 1
            self.queue.appendleft(pos)  # to the front: a retry found late would lengthen the tail
            self.events.shard_retry(self.shards[pos], st.submissions[pos], error)

    def _tail(self) -> None:
        """With nothing queued, give idle actors the runs that would finish last."""
        import ray
        if not self.config.speculative_tail or self.queue:
            return
        idle = [s for s in self.pool.slots.values() if s.state is SlotState.READY and not s.runs]
        if not idle:
            return
        now = time.monotonic()
        median = statistics.median(self.durations) if self.durations else None
        candidates: list[tuple[int, float, Any, Run]] = []
        for ref, run in self.runs.items():
            if run.cancelled or self.state.copies[run.pos] != 1 or self.state.status[run.pos]:
                continue
            if run.started_at is None:
                candidates.append((0, run.submitted_at, ref, run))  # queued behind another shard
            elif median is not None and now - run.started_at >= self.config.speculative_after * median:
                candidates.append((1, run.started_at, ref, run))  # a straggler: oldest first
        candidates.sort(key=lambda c: (c[0], c[1]))
        for slot, (kind, _, ref, run) in zip(idle, candidates):
            # A moved run keeps its attempt number: the queued original is cancelled before it
            # starts (or, if it started meanwhile, each writes under its own attempt token and
            # the first to commit wins; the other's objects are orphans, see workers.output.layout).
            self._submit(run.pos, slot, speculative=kind == 1, attempt=run.attempt if kind == 0 else None)
            if kind == 0:
                self.stats.tail_moves += 1
                run.cancelled = True
                ray.cancel(ref)  # if it started meanwhile, it finishes and the first commit wins
            else:
                self.stats.speculative_runs += 1


def _index(shard: Any, pos: int) -> int:
    return int(getattr(shard, "index", pos))


def _cluster_resources() -> str:
    import ray
    try:
        return str({k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})
    except Exception:  # noqa: BLE001 - only used to word an error message
        return "(unknown resources)"


def run_shards(
    shards: Sequence[Any],
    worker_cls: type,
    worker_args: tuple,
    config: DispatchConfig,
    events: DispatchEvents | None = None,
) -> DispatchResult:
    """Run every shard on actors of `worker_cls(*worker_args)` and return when all settled.

    `worker_cls` is a plain class with `startup_report() -> dict` and
    `run_shard(shard, attempt) -> result` (see workers.actor.GenerationWorker); it runs as a Ray
    actor with `config`'s resources. Ray must be initialised. Raises DispatchError when the job
    cannot go on (actors keep failing to start, or none can be placed).
    """
    import ray
    if not ray.is_initialized():
        raise DispatchError("Ray is not initialised: connect with ray.init() before dispatching")
    pool = ActorPool(
        worker_cls,
        worker_args,
        num_cpus=config.num_cpus,
        num_gpus=config.num_gpus,
        resources=dict(config.resources),
    )
    try:
        result = Dispatcher(shards, pool, config, events or DispatchEvents()).run()
    except BaseException:
        pool.stop_all()
        raise
    # Every actor was killed when the loop ended; wait until none can write any more.
    result.unfenced_actors = wait_actors_gone(pool.handles, config.fence_timeout_s)
    return result
