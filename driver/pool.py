"""The actor pool behind dispatch: starting, tracking and stopping worker actors.

An actor goes STARTING (created; its `startup_report()` call is in flight, which may wait for a
node: an actor Ray cannot place yet pends, and that pending demand is what makes Ray's
autoscaler add nodes) -> READY (report returned; takes shards) -> gone (died, failed to start,
retired or replaced). Each actor runs its calls one at a time in submission order, so of the
runs queued on it, the first is executing and the rest wait behind it.
"""

from __future__ import annotations

# Ray is imported inside the functions that use it: `ditfleet validate` and `plan` import this
# module (for its types) and must not pay for loading Ray.
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


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


@dataclass
class Slot:
    """One actor as the pool sees it."""

    id: int
    handle: Any  # ray ActorHandle
    state: SlotState
    created_at: float
    startup_ref: Any = None  # ObjectRef of startup_report() while STARTING
    ready_at: float | None = None
    worker_id: str = ""
    runs: deque = field(default_factory=deque)  # ObjectRefs of its runs, in submission order
    idle_since: float | None = None
    consecutive_failures: int = 0


def short_error(error: BaseException, limit: int = 300) -> str:
    """One line for logs and summaries: the exception type and the last line of its message
    (Ray wraps remote errors in a traceback whose last line is the original exception)."""
    import ray
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = getattr(error, "cause", None)
    name = type(cause).__name__ if isinstance(cause, BaseException) else type(error).__name__
    last = lines[-1] if lines else ""
    if isinstance(error, ray.exceptions.RayActorError) and lines:
        # "The actor died unexpectedly ..." is the informative first line; the cause follows.
        last = next((line for line in lines if "actor" in line.lower()), lines[0])
        tail = lines[-1]
        if "creation task" in lines[0] and tail != last:
            last = f"{lines[0]} {tail}"
    message = f"{name}: {last}" if last and not last.startswith(name) else (last or name)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def error_kind(error: BaseException) -> str:
    """A short class for counting failures: 'actor_died', or the remote exception's type name."""
    import ray
    if isinstance(error, ray.exceptions.RayActorError):
        return "actor_died"
    cause = getattr(error, "cause", None)
    return type(cause if isinstance(cause, BaseException) else error).__name__


class ActorPool:
    """Creates actors of one class with fixed resources and tracks them by slot id.

    The pool never blocks: `start` returns at once (the actor may pend for minutes while a node
    is added), and readiness arrives through the startup ref the dispatcher waits on.
    """

    def __init__(
        self,
        worker_cls: type,
        worker_args: tuple,
        num_cpus: float,
        num_gpus: float,
        resources: dict[str, float] | None = None,
    ) -> None:
        # max_restarts=0 and no task retries: a dead actor is replaced by the dispatcher, which
        # knows which shard it held and requeues it; Ray retrying behind its back would run the
        # shard again without the attempt count.
        import ray
        self._actor_cls = ray.remote(worker_cls).options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=dict(resources or {}),
            max_restarts=0,
            max_task_retries=0,
        )
        self._args = worker_args
        self.slots: dict[int, Slot] = {}
        self.handles: list[Any] = []  # every actor ever started: all are fenced at the end
        self._next_id = 0
        self.started = 0

    def start(self) -> Slot:
        handle = self._actor_cls.remote(*self._args)
        self.handles.append(handle)
        slot = Slot(
            id=self._next_id,
            handle=handle,
            state=SlotState.STARTING,
            created_at=time.monotonic(),
            startup_ref=handle.startup_report.remote(),
        )
        self._next_id += 1
        self.started += 1
        self.slots[slot.id] = slot
        return slot

    def mark_ready(self, slot: Slot, report: dict) -> None:
        slot.state = SlotState.READY
        slot.startup_ref = None
        slot.ready_at = slot.idle_since = time.monotonic()
        slot.worker_id = str(report.get("worker_id") or f"actor-{slot.id}")

    def stop(self, slot: Slot) -> None:
        """Kill the actor (no-op if it is already dead) and forget it."""
        import ray
        self.slots.pop(slot.id, None)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is fine; nothing else to do about it
            pass

    def stop_all(self) -> None:
        for slot in list(self.slots.values()):
            self.stop(slot)

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots.values() if s.state is state)
