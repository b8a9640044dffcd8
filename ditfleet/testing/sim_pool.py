"""A simulated fleet for the dispatch policy: thousands of actors on a virtual clock, spot churn.

`FleetSim` is an `ActorPool` whose actors start in `startup_s`, run their queued shards one at a
time in `shard_s` each (with jitter), and are reclaimed at random like spot nodes (`reclaim_per_hour`
of the fleet per hour): with notice the running shard is given up (the worker's SIGTERM path,
`ShardAbandoned`), without it the actor just dies; and sometimes just after its manifest was written
but before the result came back, so the retry finds the shard committed. Its `manifests` are the
store's create-only commit: the first commit of a shard wins, later ones read "already_committed".
With `prepare_s`, a run first waits that long for its rows (the device idle) unless the dispatcher
announced it (`prefetch`) at least that long before it started; `input_wait_s` sums the waits.

Events sit in a heap, so a wait costs O(log events) whatever the fleet size; with
`charge_driver` the driver's own CPU time between waits is added to the virtual clock, so a slow
dispatcher shows up as lost efficiency instead of being free. It is used by the capacity bench
(bench/driver_fleet.py) and the policy's tests; nothing in a real job runs it. No Ray here.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from ditfleet.driver.dispatch.slots import ACTOR_DIED, CANCELLED, LEAVING, ActorPool, RunError, Slot
from ditfleet.workers.contract import ShardResult

_READY, _END, _RECLAIM = 0, 1, 2
_HOUR = 3600.0


@dataclass
class _Run:
    ref: int
    actor: int
    shard: Any
    attempt: int
    seconds: float
    started_at: float | None = None
    announced_at: float | None = None  # when the dispatcher announced it (prefetch)
    wait_s: float = 0.0  # for its rows, before its device work


@dataclass
class _Actor:
    id: int
    created_at: float
    ready_at: float
    queue: deque = field(default_factory=deque)
    dead_at: float | None = None
    ready: bool = False
    busy_s: float = 0.0  # time its GPU spent on shards (partial runs included)


@dataclass
class FleetCost:
    """What the simulated fleet really spent, in actor-seconds (x GPUs per actor = GPU-seconds)."""

    actors: int = 0
    lifetime_s: float = 0.0
    startup_s: float = 0.0
    generating_s: float = 0.0

    @property
    def idle_s(self) -> float:
        return self.lifetime_s - self.startup_s - self.generating_s


class FleetSim(ActorPool):
    def __init__(
        self,
        shard_s: float = 60.0,
        startup_s: float = 300.0,
        jitter: float = 0.1,
        reclaim_per_hour: float = 0.0,
        notice_share: float = 0.5,
        lost_result_share: float = 0.05,
        seed: int = 0,
        charge_driver: bool = True,
        prepare_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.now = 0.0
        self.shard_s, self.startup_s, self.jitter = shard_s, startup_s, jitter
        self.reclaim_rate = reclaim_per_hour / _HOUR
        self.notice_share, self.lost_result_share = notice_share, lost_result_share
        self.random = random.Random(seed)
        self.charge_driver = charge_driver
        self.prepare_s = prepare_s
        self.input_wait_s = 0.0
        self._cpu_mark = time.process_time()
        self.driver_cpu_s = 0.0
        self.actors: dict[int, _Actor] = {}
        self.runs: dict[int, _Run] = {}
        self._events: list[tuple[float, int, int, int, int]] = []  # (t, seq, kind, actor, ref)
        self._seq, self._ids, self._refs = count(), count(), count()
        self.done: dict[Hashable, Any] = {}
        self._handed: list[Hashable] = []
        self.manifests: dict[int, int] = {}  # shard -> commits that won (must end at 1)
        self.commit_attempts = 0
        self.reclaimed = 0

    # -- the clock ---------------------------------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def _charge(self) -> None:
        mark = time.process_time()
        spent, self._cpu_mark = mark - self._cpu_mark, mark
        self.driver_cpu_s += spent
        if self.charge_driver:
            self.now += spent

    def _push(self, t: float, kind: int, actor: int, ref: int = -1) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, actor, ref))

    def _vary(self, seconds: float) -> float:
        return seconds * (1 + self.jitter * (2 * self.random.random() - 1)) if self.jitter else seconds

    # -- the pool's mechanics ----------------------------------------------------------------------

    def _create(self) -> tuple[int, Hashable]:
        actor = _Actor(next(self._ids), self.now, self.now + self._vary(self.startup_s))
        self.actors[actor.id] = actor
        self._push(actor.ready_at, _READY, actor.id)
        if self.reclaim_rate:
            self._push(self.now + self.random.expovariate(self.reclaim_rate), _RECLAIM, actor.id)
        return actor.id, ("startup", actor.id)

    def _kill(self, slot: Slot) -> None:
        actor = self.actors[slot.handle]
        if actor.dead_at is None:
            self._die(actor, report=False)
        # The dispatcher forgets this actor's runs itself: results it would never collect go.
        for run in actor.queue:
            self.done.pop(run.ref, None)
            self.runs.pop(run.ref, None)
        self.done.pop(("startup", actor.id), None)
        actor.queue.clear()

    def submit(self, slot: Slot, shard: Any, attempt: int) -> Hashable:
        actor = self.actors[slot.handle]
        run = _Run(next(self._refs), actor.id, shard, attempt, self._vary(self.shard_s))
        self.runs[run.ref] = run
        actor.queue.append(run)
        if len(actor.queue) == 1:
            self._start(actor, run)
        return run.ref

    def prefetch(self, slot: Slot, shard: Any) -> None:
        for run in self.actors[slot.handle].queue:
            if run.shard is shard and run.announced_at is None:
                run.announced_at = self.now

    def cancel(self, ref: Hashable) -> None:
        run = self.runs.get(ref)  # type: ignore[call-overload]
        actor = self.actors[run.actor] if run is not None else None
        if run is None or actor is None or run.started_at is not None or actor.dead_at is not None:
            return  # done, running (a running call is not interrupted) or gone with its actor
        actor.queue.remove(run)
        del self.runs[run.ref]
        self.done[run.ref] = RunError(CANCELLED, "TaskCancelledError", "cancelled")

    def wait(self, refs: Sequence[Hashable], timeout_s: float) -> list[Hashable]:
        """Advance to the next events (at most timeout_s) and report what is done."""
        self._charge()
        for ref in self._handed:  # handed out and not collected: the dispatcher dropped them
            self.done.pop(ref, None)
        until = self.now + timeout_s
        while not self.done and self._events and self._events[0][0] <= until:
            t, _, kind, actor_id, ref = heapq.heappop(self._events)
            self.now = max(self.now, t)
            self._event(kind, self.actors[actor_id], ref)
        if not self.done:
            self.now = until
        self._handed = list(self.done)
        self._cpu_mark = time.process_time()
        return self._handed

    def startup_outcome(self, slot: Slot) -> dict | RunError:
        return self.done.pop(slot.startup_ref)

    def run_outcome(self, ref: Hashable) -> ShardResult | RunError:
        return self.done.pop(ref)

    # -- events ------------------------------------------------------------------------------------

    def _event(self, kind: int, actor: _Actor, ref: int) -> None:
        if actor.dead_at is not None:
            return
        if kind == _READY:
            actor.ready = True
            self.done[("startup", actor.id)] = {"worker_id": f"sim-{actor.id}"}
        elif kind == _END:
            self._end(actor, ref)
        else:
            self._reclaim(actor)

    def _start(self, actor: _Actor, run: _Run) -> None:
        run.started_at = self.now
        ahead = self.now - run.announced_at if run.announced_at is not None else 0.0
        run.wait_s = max(0.0, self.prepare_s - ahead)
        self.input_wait_s += run.wait_s
        self._push(self.now + run.wait_s + run.seconds, _END, actor.id, run.ref)

    def _commit(self, run: _Run) -> str:
        self.commit_attempts += 1
        index = run.shard.index
        if index in self.manifests:
            return "already_committed"
        self.manifests[index] = 1
        return "committed"

    def _end(self, actor: _Actor, ref: int) -> None:
        run = actor.queue.popleft()
        assert run.ref == ref, "runs end in submission order"
        del self.runs[ref]
        actor.busy_s += run.seconds
        status = self._commit(run)
        images = getattr(run.shard, "num_images", 1)
        self.done[ref] = ShardResult(
            run.shard.index,
            run.attempt,
            status,
            rows=getattr(run.shard, "num_rows", 1),
            images_ok=images if status == "committed" else 0,
            generate_s=run.seconds,
            wall_s=run.wait_s + run.seconds,
            worker_id=f"sim-{actor.id}",
        )
        if actor.queue:
            self._start(actor, actor.queue[0])

    def _reclaim(self, actor: _Actor) -> None:
        self.reclaimed += 1
        head = actor.queue[0] if actor.queue else None
        if head is not None and head.started_at is not None:
            actor.busy_s += max(0.0, self.now - head.started_at - head.wait_s)
            draw = self.random.random()
            if draw < self.lost_result_share:
                self._commit(head)  # the manifest was written; the result never came back
            elif draw < self.lost_result_share + self.notice_share and actor.ready:
                # SIGTERM first: the worker gives the shard up, uncommitted, then the node goes.
                self.done[head.ref] = RunError(LEAVING, "ShardAbandoned", "ShardAbandoned: spot reclaim")
                actor.queue.popleft()
                del self.runs[head.ref]
        self._die(actor, report=True)

    def _die(self, actor: _Actor, report: bool) -> None:
        actor.dead_at = self.now
        head = actor.queue[0] if actor.queue else None
        if head is not None and head.started_at is not None and report is False:
            actor.busy_s += max(0.0, self.now - head.started_at - head.wait_s)
        if report:
            for run in actor.queue:
                self.done[run.ref] = RunError(ACTOR_DIED, "actor_died", "ActorDiedError: spot node reclaimed")
            if not actor.ready:
                self.done[("startup", actor.id)] = RunError(
                    ACTOR_DIED, "actor_died", "ActorDiedError: spot node reclaimed"
                )

    # -- what the fleet spent ----------------------------------------------------------------------

    def cost(self) -> FleetCost:
        cost = FleetCost()
        for actor in self.actors.values():
            end = actor.dead_at if actor.dead_at is not None else self.now
            cost.actors += 1
            cost.lifetime_s += end - actor.created_at
            cost.startup_s += min(actor.ready_at, end) - actor.created_at
            cost.generating_s += actor.busy_s
        return cost
