"""Dispatch: feed shards to an elastic pool of worker actors until each is committed or failed.

Pull, not a static split: an actor gets a shard when it has room, so an actor that joins late
or runs fast simply does more. Each ready actor holds up to `shards_in_flight_per_actor` runs
(one executing, the rest queued on the actor) so its GPU never waits for a round trip. The run
queued right behind the executing one is announced to its actor (`ActorPool.prefetch`, one ahead
at most, `DispatchConfig.prefetch`), which prepares that shard meanwhile (workers.prefetch: its
rows, inputs and first batch); only a hint: the queued run is what runs the shard, and a run that
never starts there is settled as any queued run.

Failures: a shard whose run raises, or whose actor dies, goes back to the front of the queue;
after `max_attempts` failed runs it is reported failed and the job goes on. A dead actor is
replaced while shards wait. Runs that were only queued behind the failed one on a dead actor go
back without using up an attempt, and so does the shard of a worker that was asked to stop
(`workers.contract.ShardAbandoned`).

Tail: when the queue is empty and actors sit idle, shards queued behind another one on a busy
actor move to an idle actor (the queued call is cancelled), and shards that have run much longer
than the median get a second, speculative run. The first commit wins: the worker's create-only
manifest write guarantees at most one manifest per shard, and only the first result is counted.
Each run writes its objects under its own attempt token, so a twin never touches what the
winner's manifest names. When the last shard settled, every actor is killed; the result names
every actor started (`DispatchResult.actors`), so that the caller can wait until their processes
are gone (driver.run_job, with driver.output.fence) before it writes `_SUCCESS`.

Cost per event is O(in-flight runs) (the actors with room are tracked, not scanned; retirement
scans the actors only when one can be due); driver memory is O(shards), about 15 bytes a shard in
the book (bench/driver_fleet.py: 1,000 actors, 400,000 shards).

Modules: `types` (config, events, result; what progress, metrics and the job spec import),
`slots` (actors and runs as the policy sees them, and the pool interface), `book` (shard state),
`policy` (the decisions), `ray_pool` (the pool on Ray, and the only module that imports Ray).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ditfleet.driver.dispatch.types import (
    DispatchConfig,
    DispatchError,
    DispatchEvents,
    DispatchResult,
    DispatchSnapshot,
    DispatchStats,
    ShardFailure,
)

if TYPE_CHECKING:
    from ditfleet.workers.rows import ShardSpec

__all__ = [
    "DispatchConfig",
    "DispatchError",
    "DispatchEvents",
    "DispatchResult",
    "DispatchSnapshot",
    "DispatchStats",
    "ShardFailure",
    "run_shards",
]


def run_shards(
    shards: Sequence[ShardSpec],
    worker_cls: type,
    worker_args: tuple,
    config: DispatchConfig,
    events: DispatchEvents | None = None,
    keep_results: bool = True,
) -> DispatchResult:
    """Run every shard on actors of `worker_cls(*worker_args)` and return when all settled.

    `worker_cls` is a plain class with `startup_report() -> dict` and
    `run_shard(shard, attempt) -> workers.contract.ShardResult` (see workers.actor.GenerationWorker);
    it runs as a Ray actor with `config`'s resources. Ray must be initialised. Raises
    DispatchError when the job cannot go on (actors keep failing to start, or none can be placed).
    Every actor is killed when it returns; `result.actors` holds them all for the caller's fence
    (killing is asynchronous: a process may still write for a moment).
    keep_results=False keeps no per-shard result (a job's 400,000 shards): `events` sees each.
    """
    # Ray loads here, not with the package: `ditfleet validate` and `plan` import the types.
    from ditfleet.driver.dispatch.policy import Dispatcher
    from ditfleet.driver.dispatch.ray_pool import RayActorPool

    pool = RayActorPool(worker_cls, worker_args, config)
    # The loop kills every actor when it ends, on an error too.
    result = Dispatcher(shards, pool, config, events or DispatchEvents(), keep_results=keep_results).run()
    result.actors = pool.handles
    return result
