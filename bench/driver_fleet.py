"""Dispatch for a fleet: 1,000 actors and 400,000 shards on a simulated pool with a virtual clock.

    python bench/driver_fleet.py                                   # 1,000 actors, 400,000 shards
    python bench/driver_fleet.py --actors 100 --shards 20000 --churn 0.1

The policy is the real one (driver.dispatch.policy); the actors are ditfleet.testing.sim_pool's
FleetSim: 60 s shards (+-10%), 300 s start-up, and with --churn that share of the fleet reclaimed
per simulated hour (half with notice, 5% just after their manifest was written), replacements
joining as the dispatcher starts them. The driver's own CPU time is charged to the virtual
clock, so it costs efficiency as it would on a real head. Printed as one JSON line:

- `driver_cpu_ms_per_shard`: the dispatcher's process CPU time / shards (the loop, the book, the
  progress events; the simulator's own share is in it too, so this is an upper bound);
- `efficiency` = shards x mean shard time / actors / (wall from the last first-wave actor ready
  to the last shard settled): 1.0 is every GPU busy all the time;
- `book_bytes_per_shard`: Python heap held by the dispatcher's book, per shard (tracemalloc,
  measured on a separate small run so that tracing does not slow the timed one);
- `committed_once`: every shard has exactly one winning manifest and the dispatcher counted each
  once; `fleet`: GPU hours (1 GPU an actor) split into start-up, generating and idle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.driver.dispatch import DispatchConfig, DispatchEvents  # noqa: E402
from ditfleet.driver.dispatch.policy import Dispatcher  # noqa: E402
from ditfleet.driver.progress import JobProgress  # noqa: E402
from ditfleet.testing.sim_pool import FleetSim  # noqa: E402


class _FirstWave(DispatchEvents):
    def __init__(self, actors: int, pool: FleetSim) -> None:
        self.actors, self.pool, self.ready = actors, pool, 0
        self.all_ready_at: float | None = None
        self.done_before = self.committed = 0

    def actor_ready(self, worker_id, report, startup_s) -> None:
        self.ready += 1
        if self.ready == self.actors:
            self.all_ready_at, self.done_before = self.pool.now, self.committed

    def shard_committed(self, shard, result) -> None:
        self.committed += 1


class _Both(DispatchEvents):
    """The bench's own counters and the real progress display (as run_job feeds it)."""

    def __init__(self, *sinks) -> None:
        self.sinks = sinks

    def __getattribute__(self, name):
        if name.startswith("_") or name == "sinks":
            return object.__getattribute__(self, name)
        calls = [getattr(s, name) for s in object.__getattribute__(self, "sinks")]
        return lambda *a, **k: [c(*a, **k) for c in calls][-1]


def shards(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(index=i, num_images=1, num_rows=1, buckets_used=("1328x1328",)) for i in range(n)]


def run(actors: int, n: int, shard_s: float, startup_s: float, churn: float, seed: int = 0) -> dict:
    pool = FleetSim(shard_s=shard_s, startup_s=startup_s, reclaim_per_hour=churn, seed=seed)
    config = DispatchConfig(min_actors=actors, max_actors=actors, idle_retire_s=60, tick_s=5.0)
    first = _FirstWave(actors, pool)
    with open(os.devnull, "w") as devnull:
        progress = JobProgress(total_shards=n, total_images=n, stream=devnull, interactive=False)
        cpu0, t0 = time.process_time(), time.perf_counter()
        result = Dispatcher(
            shards(n), pool, config, _Both(first, progress), pool.clock, keep_results=False
        ).run()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
        progress.close()
    counted = result.committed
    hours = 1 / 3600
    once = (
        len(pool.manifests) == n
        and all(v == 1 for v in pool.manifests.values())
        and counted == n
        and not result.failed
    )
    steady = n - first.done_before
    steady_wall = pool.now - (first.all_ready_at or 0.0)
    cost = pool.cost()
    return {
        "bench": "driver_fleet",
        "actors": actors,
        "shards": n,
        "shard_s": shard_s,
        "startup_s": startup_s,
        "churn_per_hour": churn,
        "driver_cpu_s": round(cpu_s, 2),
        "driver_cpu_ms_per_shard": round(1000 * cpu_s / n, 4),
        "real_wall_s": round(wall_s, 2),
        "virtual_wall_h": round(pool.now / 3600, 3),
        "efficiency": round(steady * shard_s / actors / steady_wall, 4) if steady_wall > 0 else None,
        "committed_once": once,
        "reclaimed": pool.reclaimed,
        "actors_started": result.stats.actors_started,
        "retries": result.stats.retries,
        "duplicate_results": result.stats.duplicate_results,
        "driver_fleet_view": {  # what the dispatcher itself accounted (ready = generating + idle)
            "startup_actor_h": round(result.startup_actor_s * hours, 1),
            "ready_actor_h": round(result.ready_actor_s * hours, 1),
            "busy_actor_h": round(result.busy_actor_s * hours, 1),
        },
        "fleet": {
            "gpu_hours": round(cost.lifetime_s * hours, 1),
            "startup_gpu_hours": round(cost.startup_s * hours, 1),
            "generating_gpu_hours": round(cost.generating_s * hours, 1),
            "idle_gpu_hours": round(cost.idle_s * hours, 1),
            "images_per_gpu_hour": round(n / (cost.lifetime_s * hours), 2),
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def book_bytes_per_shard(n: int = 100_000) -> float:
    """Heap the dispatcher's book takes per shard when every shard is queued (its peak: the
    shards themselves are the plan's, not counted)."""
    from ditfleet.driver.dispatch.book import ShardBook

    specs = shards(n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    book = ShardBook(specs, keep_results=False)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del book
    return grown / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=400_000)
    parser.add_argument("--shard-s", type=float, default=60.0)
    parser.add_argument("--startup-s", type=float, default=300.0)
    parser.add_argument("--churn", type=float, nargs="+", default=[0.0, 0.1], help="reclaimed share per hour")
    args = parser.parse_args()
    per_shard = round(book_bytes_per_shard(), 1)
    for churn in args.churn:
        line = run(args.actors, args.shards, args.shard_s, args.startup_s, churn)
        line["book_bytes_per_shard"] = per_shard
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
