"""The pool of worker actors as the dispatch policy sees it: slots, runs, and what a pool must do.

An actor goes STARTING (created; its `startup_report()` call is in flight, which may wait for a
node: an actor Ray cannot place yet pends, and that pending demand is what makes Ray's
autoscaler add nodes) -> READY (report returned; takes shards) -> gone (died, failed to start,
retired or replaced). Each actor runs its calls one at a time in submission order, so of the
runs queued on it, the first is executing and the rest wait behind it.

`ActorPool` keeps the slots; how actors are created, called, waited on and killed is left to a
subclass: `driver.dispatch.ray_pool.RayActorPool` on a cluster, a simulated pool in the policy's
unit tests. No Ray here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditfleet.driver.actor_phases import ActorPhase
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec


class SlotState(Enum):
    STARTING = "starting"
    READY = "ready"


@dataclass
class Run:
    """One submission of a shard to an actor (a shard may have two: a speculative copy)."""

    pos: int  # position of the shard in the dispatch's shard list
    attempt: int  # passed to run_shard and recorded in the manifest; from 0, one per submission
    slot: int
    submitted_at: float
    started_at: float | None = None  # when it reached the head of its actor's queue (estimate)
    speculative: bool = False
    cancelled: bool = False  # we cancelled it (a queued copy whose twin committed or moved)
    prefetched: bool = False  # announced to its actor to prepare ahead (ActorPool.prefetch)


@dataclass
class Slot:
    """One actor as the pool sees it."""

    id: int
    handle: Any  # the pool's handle of the actor (a Ray ActorHandle on a cluster)
    state: SlotState
    created_at: float
    startup_ref: Hashable = None  # the pending startup_report() while STARTING
    ready_at: float | None = None
    worker_id: str = ""
    runs: deque = field(default_factory=deque)  # refs of its runs, in submission order
    idle_since: float | None = None
    consecutive_failures: int = 0

    @property
    def name(self) -> str:
        """The worker id once ready; before that, the slot's number."""
        return self.worker_id or f"actor-{self.id}"


# Why a run (or a start-up) returned no result.
CANCELLED = "cancelled"  # cancelled before it started
ACTOR_DIED = "actor_died"  # its actor died (crash, kill, node loss)
LEAVING = "leaving"  # the worker was asked to stop and gave the shard up (workers.contract.ShardAbandoned)
RAISED = "raised"  # run_shard (or the actor's constructor) raised


@dataclass(frozen=True)
class RunError:
    """A run's or a start-up's failure, as the pool judged the exception."""

    reason: str  # CANCELLED | ACTOR_DIED | LEAVING | RAISED
    kind: str  # for counting: 'actor_died' or the remote exception's type name
    text: str  # one line, at most 300 characters
    detail: str = ""  # the same, up to 2000 characters, for an error that stops the job
    cause: BaseException | None = None


class ActorPool(ABC):
    """Slots by id, and the mechanics a subclass provides: create, call, wait, cancel, kill.

    Nothing blocks but `wait`: `start` returns at once (the actor may pend for minutes while a
    node is added), and readiness arrives through the startup ref the dispatcher waits on.
    """

    def __init__(self) -> None:
        self.slots: dict[int, Slot] = {}
        # The ready slots, by id in the order they became ready: with 1,000 actors the policy
        # asks for them on every event, and counting the dict each time was most of its cost.
        self.ready: dict[int, Slot] = {}
        self._next_id = 0

    def start(self, now: float) -> Slot:
        handle, startup_ref = self._create()
        slot = Slot(self._next_id, handle, SlotState.STARTING, created_at=now, startup_ref=startup_ref)
        self._next_id += 1
        self.slots[slot.id] = slot
        return slot

    def mark_ready(self, slot: Slot, report: dict, now: float) -> None:
        slot.state = SlotState.READY
        self.ready[slot.id] = slot
        slot.startup_ref = None
        slot.ready_at = slot.idle_since = now
        slot.worker_id = str(report.get("worker_id") or f"actor-{slot.id}")

    def stop(self, slot: Slot) -> None:
        """Kill the actor (no-op if it is already dead) and forget it."""
        self.slots.pop(slot.id, None)
        self.ready.pop(slot.id, None)
        self._kill(slot)

    @abstractmethod
    def _create(self) -> tuple[Any, Hashable]:
        """Create an actor; return its handle and the ref of its startup_report() call."""

    @abstractmethod
    def _kill(self, slot: Slot) -> None:
        """Kill the actor; it may be dead already."""

    @abstractmethod
    def submit(self, slot: Slot, shard: ShardSpec, attempt: int) -> Hashable:
        """Queue run_shard(shard, attempt) on the actor; return a ref to wait on."""

    def prefetch(self, slot: Slot, shard: ShardSpec) -> None:
        """Tell the actor that `shard` is queued right behind its running call, so that it
        prepares it meanwhile (workers.prefetch). Only a hint, answered by nothing: the queued
        run is what runs it. A pool whose actors cannot prepare ahead does nothing."""
        return None

    @abstractmethod
    def cancel(self, ref: Hashable) -> None:
        """Cancel a queued run; one that started meanwhile runs to its end."""

    @abstractmethod
    def wait(self, refs: Sequence[Hashable], timeout_s: float) -> list[Hashable]:
        """The refs (runs and start-ups) that are done, waiting at most timeout_s for one."""

    @abstractmethod
    def startup_outcome(self, slot: Slot) -> dict | RunError:
        """The done start-up of `slot`: its report, or why it failed."""

    @abstractmethod
    def run_outcome(self, ref: Hashable) -> ShardResult | RunError:
        """The done run `ref`: the worker's result, or why there is none."""

    def phases(self, slots: list[Slot], now: float) -> tuple[ActorPhase, ...]:
        """Where each starting actor is (for progress); a pool that cannot tell says nothing."""
        return ()

    def describe_resources(self) -> str:
        """The cluster's resources, for the error when no actor can be placed."""
        return "(unknown resources)"
