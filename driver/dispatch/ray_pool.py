"""Worker actors on Ray: the `ActorPool` that `driver.dispatch.run_shards` hands the policy.

Every Ray call of dispatch is here: creating actors with the job's resources, queuing
`run_shard` calls, waiting, cancelling, killing, and turning Ray's exceptions into `RunError`s
(a worker's `ShardAbandoned` is recognised by its type: Ray raises a `RayTaskError` that is also
an instance of the worker's exception class when the driver can import it, as here).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any, cast

import ray
from ray import ObjectRef
from ray.actor import ActorClass
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError

from ditfleet.driver.actor_phases import ActorPhase, PhaseTracker, actor_id
from ditfleet.driver.dispatch.slots import (
    ACTOR_DIED,
    CANCELLED,
    LEAVING,
    RAISED,
    ActorPool,
    RunError,
    Slot,
    SlotState,
)
from ditfleet.driver.dispatch.types import DispatchConfig, DispatchError
from ditfleet.workers.contract import ShardAbandoned, ShardResult
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.startup_phase import forget_phase

PREFETCH_GROUP = "prefetch"  # the actor's concurrency group for its `prepare_ahead` calls


def _remote_cause(error: BaseException) -> BaseException:
    """The exception the actor raised, for an error that Ray wrapped; else the error itself."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


def short_error(error: BaseException, limit: int = 300) -> str:
    """One line for logs and summaries: the exception type and the last line of its message
    (Ray wraps remote errors in a traceback whose last line is the original exception)."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    name = type(_remote_cause(error)).__name__
    last = lines[-1] if lines else ""
    if isinstance(error, RayActorError) and lines:
        # "The actor died unexpectedly ..." is the informative first line; the cause follows.
        last = next((line for line in lines if "actor" in line.lower()), lines[0])
        tail = lines[-1]
        if "creation task" in lines[0] and tail != last:
            last = f"{lines[0]} {tail}"
    message = f"{name}: {last}" if last and not last.startswith(name) else (last or name)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def run_error(error: BaseException) -> RunError:
    """Why a Ray call returned no result."""
    if isinstance(error, TaskCancelledError):
        reason = CANCELLED
    elif isinstance(error, RayActorError):
        reason = ACTOR_DIED
    elif isinstance(error, ShardAbandoned) or isinstance(_remote_cause(error), ShardAbandoned):
        reason = LEAVING
    else:
        reason = RAISED
    # For counting failures: 'actor_died', or the remote exception's type name.
    kind = "actor_died" if isinstance(error, RayActorError) else type(_remote_cause(error)).__name__
    return RunError(reason, kind, short_error(error), short_error(error, limit=2000), error)


def _object_ref(ref: Hashable) -> ObjectRef[Any]:
    """A ref the policy hands back: the policy keeps refs opaque (Hashable), and every one this
    pool gives it (`_create`, `submit`) is a Ray ObjectRef."""
    return cast("ObjectRef[Any]", ref)


class RayActorPool(ActorPool):
    """Actors of one class with fixed resources, as Ray actors."""

    def __init__(self, worker_cls: type, worker_args: tuple, config: DispatchConfig) -> None:
        if not ray.is_initialized():
            raise DispatchError("Ray is not initialised: connect with ray.init() before dispatching")
        super().__init__()
        # max_restarts=0 and no task retries: a dead actor is replaced by the dispatcher, which
        # knows which shard it held and requeues it; Ray retrying behind its back would run the
        # shard again without the attempt count.
        # A worker that prepares its next shard ahead (workers.prefetch) takes `prepare_ahead` calls
        # on a thread of their own, beside the run_shard it is executing; run_shard calls still
        # run one at a time, in order (the default group).
        self._prefetches = config.prefetch and callable(getattr(worker_cls, "prepare_ahead", None))
        groups: dict[str, Any] = {"concurrency_groups": {PREFETCH_GROUP: 1}} if self._prefetches else {}
        # (Ray's stubs name no concurrency_groups, a documented ray.remote option: passed as **.)
        remote = ray.remote(**groups) if groups else ray.remote
        self._actor_cls: ActorClass[Any] = remote(worker_cls).options(
            num_cpus=config.num_cpus,
            num_gpus=config.num_gpus,
            resources=dict(config.resources),
            max_restarts=0,
            max_task_retries=0,
        )
        self._args = worker_args
        self.handles: list[Any] = []  # every actor ever started: all are fenced at the end
        self._phases = PhaseTracker(config.resource_request)

    def _create(self) -> tuple[Any, Hashable]:
        handle = self._actor_cls.remote(*self._args)
        self.handles.append(handle)
        return handle, handle.startup_report.remote()

    def _kill(self, slot: Slot) -> None:
        if slot.state is SlotState.STARTING:
            forget_phase(actor_id(slot.handle))
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is fine; nothing else to do about it
            pass

    def submit(self, slot: Slot, shard: ShardSpec, attempt: int) -> Hashable:
        return slot.handle.run_shard.remote(shard, attempt)

    def prefetch(self, slot: Slot, shard: ShardSpec) -> None:
        if self._prefetches:
            # Not waited on: the worker's prefetch never raises, and if the actor dies meanwhile
            # its queued run_shard reports that.
            slot.handle.prepare_ahead.options(concurrency_group=PREFETCH_GROUP).remote(shard)

    def cancel(self, ref: Hashable) -> None:
        ray.cancel(ref)

    def wait(self, refs: Sequence[Hashable], timeout_s: float) -> list[Hashable]:
        if not refs:
            time.sleep(min(timeout_s, 0.05))  # nothing in flight: actors are started next turn
            return []
        ready, rest = ray.wait(list(refs), num_returns=1, timeout=timeout_s)
        if ready and rest:
            # Settle everything that is already done in one pass: fewer loop turns under load.
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        return ready

    def startup_outcome(self, slot: Slot) -> dict | RunError:
        forget_phase(actor_id(slot.handle))
        try:
            return dict(ray.get(_object_ref(slot.startup_ref)) or {})
        except Exception as e:  # noqa: BLE001 - any start failure is reported, then replaced
            return run_error(e)

    def run_outcome(self, ref: Hashable) -> ShardResult | RunError:
        try:
            return ray.get(_object_ref(ref))
        except Exception as e:  # noqa: BLE001 - every failure of a run is judged by the policy
            return run_error(e)

    def phases(self, slots: list[Slot], now: float) -> tuple[ActorPhase, ...]:
        return self._phases.poll(slots, now)

    def describe_resources(self) -> str:
        try:
            return str({k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})
        except Exception:  # noqa: BLE001 - only used to word an error message
            return "(unknown resources)"
