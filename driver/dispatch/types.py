"""What dispatch takes and gives: its config, its events, its result. No Ray here.

`driver.progress`, `driver.metrics`, `driver.output.summary` and the job spec import these; so do
`ditfleet validate` and `plan`, which must not pay for loading Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ditfleet.driver.actor_phases import ActorPhase
from ditfleet.model.knobs import bounded, check_settings, setting

if TYPE_CHECKING:
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec


class DispatchError(RuntimeError):
    """The job cannot go on: actors keep failing to start, or none can be placed."""


@dataclass(frozen=True)
class DispatchConfig:
    """How many actors, with what resources, and how shards are retried and duplicated."""

    min_actors: int = setting(1, ge=1, description="Actors started at once and kept while shards wait.")
    max_actors: int = 1  # grown to while shards wait; actors Ray cannot place yet just pend
    num_gpus: float = bounded(0.0, ge=0)  # per actor
    num_cpus: float = setting(1.0, ge=0, description="CPUs per actor (encode/upload threads run on them).")
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources per actor
    # 1 running + queued ones
    shards_in_flight_per_actor: int = setting(
        2, ge=1, le=8, description="Shards queued per actor, so its GPU never waits."
    )
    max_attempts: int = setting(
        3, ge=1, le=100, description="Failed runs of a shard before it is reported failed."
    )
    speculative_tail: bool = setting(
        True, description="Near the end, rerun slow shards on idle actors; the first commit wins."
    )
    speculative_after: float = bounded(
        1.5, gt=0
    )  # a running shard is duplicated after this x the median shard time
    idle_retire_s: float = setting(
        10.0, ge=0, description="Stop an actor idle this long once nothing is queued."
    )
    shard_timeout_s: float | None = bounded(
        None, gt=0
    )  # a run longer than this kills its actor (None: no limit)
    placement_timeout_s: float | None = setting(
        1800.0, gt=0, description="Give up when no actor can be placed for this long; null: wait forever."
    )
    # Announce to an actor the run queued right behind its executing one, so that it reads
    # that shard's rows and encodes its first batch while the current shard generates
    # (workers.prefetch). Needs shards_in_flight_per_actor >= 2 (a run queued behind another).
    prefetch: bool = True
    max_start_failures: int = bounded(3, ge=1)  # actors failing to start in a row (none ready between): stop
    tick_s: float = bounded(0.5, gt=0)  # longest wait between checks of timers (retirement, tail, progress)
    # After the last shard settled, wait this long at most for every actor's process to be gone
    # (driver.output.fence), so that no run can still write when the driver writes _SUCCESS.
    fence_timeout_s: float = bounded(60.0, ge=0)

    def __post_init__(self) -> None:
        check_settings(self)  # every field's bounds
        if self.max_actors < self.min_actors:
            raise ValueError(
                f"DispatchConfig.max_actors must be >= min_actors, got {self.max_actors} < {self.min_actors}"
            )

    @property
    def resource_request(self) -> dict[str, float]:
        """What each actor asks Ray for."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.resources)}


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
    prefetches: int = 0  # queued runs announced to their actor to prepare ahead (workers.prefetch)


@dataclass
class DispatchResult:
    # The first result of each committed shard, when the dispatch was asked to keep them
    # (tests, benches); a job's dispatch keeps none: progress and metrics took each as it came.
    results: list[ShardResult]
    failed: list[ShardFailure]
    stats: DispatchStats
    wall_s: float  # from the first actor started to the last shard settled
    ready_actor_s: float  # sum over actors of the time they were ready (until the end)
    busy_actor_s: float  # sum of shard run times (executing, duplicates included)
    committed: int = 0  # shards committed by this dispatch (counted whether results are kept or not)
    # Sum over actors of the time from creation to ready (or to their end, never ready): with
    # ready_actor_s, an actor's whole lifetime; x GPUs per actor, what the fleet cost.
    startup_actor_s: float = 0.0
    gpus_per_actor: float = 0.0

    def fleet(self, images: int) -> dict[str, float]:
        """What the fleet cost: actor hours (lifetime = start-up + ready) split into start-up,
        generating (shard runs, speculative twins included) and idle, the same x GPUs per actor,
        and `images` (made by this dispatch) per GPU hour (per actor hour without GPUs)."""
        hour = 3600.0
        lifetime = self.startup_actor_s + self.ready_actor_s
        generating = min(self.busy_actor_s, self.ready_actor_s)
        parts = {
            "startup": self.startup_actor_s,
            "generating": generating,
            "idle": max(0.0, self.ready_actor_s - generating),
        }
        out: dict[str, float] = {
            "actors": self.stats.actors_started,
            "gpus_per_actor": self.gpus_per_actor,
            "actor_hours": round(lifetime / hour, 4),
        }
        if self.gpus_per_actor:
            gpu_hours = lifetime * self.gpus_per_actor / hour
            out["gpu_hours"] = round(gpu_hours, 4)
            out.update({f"{k}_gpu_hours": round(v * self.gpus_per_actor / hour, 4) for k, v in parts.items()})
            out["images_per_gpu_hour"] = round(images / gpu_hours, 2) if gpu_hours else 0.0
        else:
            out.update({f"{k}_actor_hours": round(v / hour, 4) for k, v in parts.items()})
        out["images_per_actor_hour"] = round(images * hour / lifetime, 2) if lifetime else 0.0
        return out

    # Every actor the dispatch started (Ray handles, all killed by now), for the caller's fence.
    actors: list[Any] = field(default_factory=list, repr=False, compare=False)
    # Ids of the actors whose process outlived the fence wait (driver.output.fence, driver.run_job).
    unfenced_actors: list[str] = field(default_factory=list)


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

    def shard_started(self, shard: ShardSpec, attempt: int, worker_id: str, speculative: bool) -> None: ...

    def shard_committed(self, shard: ShardSpec, result: ShardResult) -> None: ...

    def shard_retry(self, shard: ShardSpec, attempt: int, error: str) -> None: ...

    def shard_failed(self, shard: ShardSpec, failure: ShardFailure) -> None: ...

    def tick(self, snapshot: DispatchSnapshot) -> None: ...

    def finish(self) -> None:
        """Once, after dispatch is over (called by whoever ran it, not by the loop)."""
