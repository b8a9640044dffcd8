"""Dispatch at scale: shards over simulated actors on a local Ray, printed as one JSON line.

    python bench/driver_dispatch.py                         # 4,000 shards, 32 actors, 20 ms each
    python bench/driver_dispatch.py --shards 2000 --actors 16 --shard-ms 50

Each actor is a real Ray actor whose `run_shard` sleeps a fixed time, so what is measured is the
scheduling. Two numbers, side by side in one run:

- `efficiency` = ideal time / actual = (shards x shard_ms / actors) / wall time from the moment
  every actor is ready to the last result. Actor start-up is left out (it is the worker's cost,
  `startup_s`); the tail (actors idle while the last shards finish) is in. Shards that finish
  while actors are still starting count as done before the clock starts.
- `ray_ceiling`: the same computed for plain Ray with every shard submitted at once to ready
  actors (no pull, no retries, no bookkeeping): what this machine allows at all. On a small or
  busy machine Ray's per-call cost, not dispatch, is the limit; `vs_ceiling` is the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from ditfleet.driver.dispatch import DispatchConfig, DispatchEvents, run_shards  # noqa: E402


class StartLine:
    """Counts actors that have started, so that all can report ready together."""

    def __init__(self) -> None:
        self.arrived = 0

    def arrive(self) -> None:
        self.arrived += 1

    def count(self) -> int:
        return self.arrived


class SimulatedWorker:
    """The worker interface with a fixed-time run_shard and nothing else.

    With a start line, `startup_report` returns only when `actors` actors have started: on a
    small machine, starting 32 processes takes longer than the shards, and a staggered start
    would measure the machine, not the scheduling.
    """

    def __init__(self, shard_s: float, start_line=None, actors: int = 0) -> None:
        self.shard_s = shard_s
        self.worker_id = f"sim-{os.getpid()}"
        self.start_line, self.actors = start_line, actors
        if start_line is not None:
            ray.get(start_line.arrive.remote())

    def startup_report(self) -> dict:
        while self.start_line is not None and ray.get(self.start_line.count.remote()) < self.actors:
            time.sleep(0.05)
        return {"worker_id": self.worker_id}

    def run_shard(self, shard: SimpleNamespace, attempt: int) -> SimpleNamespace:
        # A SimpleNamespace, not a class of this script: a __main__ class would be pickled by
        # value with every result, an overhead the real worker's ShardResult does not have.
        t0 = time.perf_counter()
        time.sleep(self.shard_s)
        wall_s = time.perf_counter() - t0
        return SimpleNamespace(shard=shard.index, attempt=attempt, wall_s=wall_s, worker_id=self.worker_id)


def _shards(n: int) -> list[SimpleNamespace]:
    # Dispatch only reads a shard's `index`. A ShardSpec would make each simulated actor import
    # workers.rows, and through compile/ torch: 32 torch imports do not fit a small machine.
    return [SimpleNamespace(index=i, num_images=1) for i in range(n)]


class _SteadyClock(DispatchEvents):
    """Notes when the last actor became ready and how many shards were done by then."""

    def __init__(self, actors: int) -> None:
        self.actors = actors
        self.t0 = time.monotonic()
        self.ready = self.done = 0
        self.all_ready_at: float | None = None
        self.done_before_ready = 0
        self.last_done_at = self.t0

    def actor_ready(self, worker_id: str, report: dict, startup_s: float) -> None:
        self.ready += 1
        if self.ready == self.actors:
            self.all_ready_at = time.monotonic()
            self.done_before_ready = self.done

    def shard_committed(self, shard, result) -> None:
        self.done += 1
        self.last_done_at = time.monotonic()


def ray_ceiling(shards: int, actors: int, shard_s: float) -> float:
    """Efficiency of plain Ray: all shards submitted at once, round robin, to ready actors."""
    cls = ray.remote(SimulatedWorker).options(num_cpus=0)
    handles = [cls.remote(shard_s) for _ in range(actors)]
    try:
        ray.get([h.startup_report.remote() for h in handles])
        t0 = time.monotonic()
        ray.get([handles[s.index % actors].run_shard.remote(s, 0) for s in _shards(shards)])
        return shards * shard_s / actors / (time.monotonic() - t0)
    finally:
        for h in handles:
            ray.kill(h)


def bench_dispatch(shards: int = 4000, actors: int = 32, shard_ms: float = 20.0, in_flight: int = 2) -> dict:
    """Dispatch `shards` fixed-time shards over `actors` actors; Ray must be initialised."""
    shard_s = shard_ms / 1000
    config = DispatchConfig(
        min_actors=actors,
        max_actors=actors,
        num_cpus=0,
        shards_in_flight_per_actor=in_flight,
        idle_retire_s=60,
    )
    clock = _SteadyClock(actors)
    start_line = ray.remote(StartLine).options(num_cpus=0).remote()
    result = run_shards(_shards(shards), SimulatedWorker, (shard_s, start_line, actors), config, clock)
    ray.kill(start_line)
    if clock.all_ready_at is None:
        raise RuntimeError(f"only {clock.ready} of {actors} actors became ready before the shards ran out")
    steady_shards = shards - clock.done_before_ready
    steady_wall = clock.last_done_at - clock.all_ready_at
    efficiency = steady_shards * shard_s / actors / steady_wall
    ceiling = ray_ceiling(shards, actors, shard_s)
    return {
        "bench": "driver_dispatch",
        "shards": shards,
        "actors": actors,
        "shard_ms": shard_ms,
        "in_flight_per_actor": in_flight,
        "efficiency": round(efficiency, 4),
        "ray_ceiling": round(ceiling, 4),
        "vs_ceiling": round(efficiency / ceiling, 4),
        "shards_after_all_ready": steady_shards,
        "steady_wall_s": round(steady_wall, 3),
        "ideal_steady_s": round(steady_shards * shard_s / actors, 3),
        "startup_s": round(clock.all_ready_at - clock.t0, 3),
        "wall_s": round(result.wall_s, 3),
        "shards_per_s": round(steady_shards / steady_wall, 1),
        "committed": len(result.results),
        "failed": len(result.failed),
        "tail_moves": result.stats.tail_moves,
        "speculative_runs": result.stats.speculative_runs,
    }


def run_local(shards: int = 4000, actors: int = 32, shard_ms: float = 20.0, in_flight: int = 2) -> dict:
    """bench_dispatch on a local single-node Ray started (and stopped) here."""
    # The classes of this file travel by value: Ray workers cannot import modules of bench/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # A single-node cluster on loopback (see tests/support/fixtures_ray.py for why the variable).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="WARNING",
    )
    try:
        line = bench_dispatch(shards, actors, shard_ms, in_flight)
    finally:
        ray.shutdown()
    line["cpus"] = os.cpu_count()
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4000)
    parser.add_argument("--actors", type=int, default=32)
    parser.add_argument("--shard-ms", type=float, default=20.0)
    parser.add_argument("--in-flight", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(run_local(args.shards, args.actors, args.shard_ms, args.in_flight)), flush=True)


if __name__ == "__main__":
    main()
