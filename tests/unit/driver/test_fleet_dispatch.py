"""The dispatch policy at fleet scale, on ditfleet.testing.sim_pool's virtual clock: spot churn
(actors reclaimed with and without notice, some just after their manifest was written) with
replacements joining, and every shard committed exactly once; the book's memory per shard; the
fleet's cost accounted by the dispatcher. Small sizes: bench/driver_fleet.py has the 1,000-actor,
400,000-shard figures."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

from ditfleet.driver.dispatch import DispatchConfig, DispatchEvents
from ditfleet.driver.dispatch.book import ShardBook
from ditfleet.driver.dispatch.policy import Dispatcher
from ditfleet.testing.sim_pool import FleetSim


class Counts(DispatchEvents):
    def __init__(self) -> None:
        self.committed: dict[int, int] = {}
        self.lost = 0

    def shard_committed(self, shard, result) -> None:
        self.committed[shard.index] = self.committed.get(shard.index, 0) + 1

    def actor_lost(self, worker_id, kind, error, starting) -> None:
        self.lost += 1


def _shards(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(index=i, num_images=2, num_rows=1) for i in range(n)]


def _run(pool: FleetSim, n: int, actors: int, events: DispatchEvents) -> object:
    config = DispatchConfig(min_actors=actors, max_actors=actors, idle_retire_s=60, tick_s=5.0)
    return Dispatcher(_shards(n), pool, config, events, pool.clock, keep_results=False).run()


def test_under_spot_churn_every_shard_is_committed_exactly_once():
    # 40% of the fleet reclaimed per hour over a run of two hours: ~40 reclaims.
    pool = FleetSim(shard_s=60, startup_s=120, reclaim_per_hour=0.4, seed=7, charge_driver=False)
    events = Counts()
    result = _run(pool, 6000, 50, events)
    assert pool.reclaimed > 25 and events.lost >= pool.reclaimed // 2
    assert result.stats.actors_started > 50 + pool.reclaimed // 2  # replacements joined
    assert result.stats.retries > 0
    # The store: one winning manifest per shard; results lost after the write made retries
    # that found their shard committed already.
    assert sorted(pool.manifests) == list(range(6000))
    assert set(pool.manifests.values()) == {1}
    assert pool.commit_attempts > 6000
    # The dispatcher: each shard counted once, none failed, no result list kept.
    assert result.committed == 6000 and not result.failed and result.results == []
    assert events.committed == dict.fromkeys(range(6000), 1)


def test_steady_fleet_keeps_its_gpus_busy():
    pool = FleetSim(shard_s=60, startup_s=300, seed=1, charge_driver=False)
    first_ready: list[float] = []

    class Ready(DispatchEvents):
        def actor_ready(self, worker_id, report, startup_s) -> None:
            first_ready.append(pool.now)

    result = _run(pool, 10_000, 100, Ready())
    assert result.committed == 10_000
    steady = pool.now - max(first_ready[:100])
    assert 10_000 * 60 / 100 / steady >= 0.98
    # The dispatcher's own account of the fleet matches the simulator's ground truth.
    cost = pool.cost()
    assert abs(result.startup_actor_s - cost.startup_s) / cost.startup_s < 0.01
    assert abs(result.startup_actor_s + result.ready_actor_s - cost.lifetime_s) / cost.lifetime_s < 0.01
    assert abs(result.busy_actor_s - cost.generating_s) / cost.generating_s < 0.02


def test_the_book_holds_a_few_bytes_per_shard():
    shards = _shards(50_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        book = ShardBook(shards, keep_results=False)
        per_shard = (tracemalloc.get_traced_memory()[0] - before) / len(shards)
    finally:
        tracemalloc.stop()
    assert per_shard < 12, per_shard
    assert len(book.queue) == 50_000 and book.queue.popleft() == 0
    book.queue.appendleft(7)
    assert book.queue.popleft() == 7 and book.queue.popleft() == 1 and len(book.queue) == 49_998


def test_the_fleet_cost_is_stated_in_gpu_hours_in_the_summary_and_the_report():
    from ditfleet.driver.output.summary import fleet_line
    from ditfleet.jobs.report import _fleet_rows

    pool = FleetSim(shard_s=60, startup_s=600, seed=3, charge_driver=False)
    config = DispatchConfig(min_actors=10, max_actors=10, num_gpus=8, idle_retire_s=60)
    result = Dispatcher(_shards(600), pool, config, DispatchEvents(), pool.clock, keep_results=False).run()
    fleet = result.fleet(images=1200)
    cost = pool.cost()
    assert fleet["gpus_per_actor"] == 8 and fleet["actors"] == 10
    assert abs(fleet["gpu_hours"] - cost.lifetime_s * 8 / 3600) < 0.05 * fleet["gpu_hours"]
    split = fleet["startup_gpu_hours"] + fleet["generating_gpu_hours"] + fleet["idle_gpu_hours"]
    assert abs(split - fleet["gpu_hours"]) < 1e-3
    assert abs(fleet["startup_gpu_hours"] - 10 * 600 * 8 / 3600) < 1.5  # 10 actors x 600 s (+-10%)
    assert fleet["images_per_gpu_hour"] == round(1200 / fleet["gpu_hours"], 2)
    line = fleet_line(fleet)
    assert line.startswith(f"{fleet['gpu_hours']:.1f} GPU hours over 10 actors (start-up ")
    assert "images per GPU hour" in line
    assert _fleet_rows({"fleet": fleet}) == [["fleet cost", line]]
    assert _fleet_rows({}) == []


def test_prefetch_hides_the_row_reads_under_churn_and_commits_exactly_once():
    # Each shard needs 10 s of reads before its 60 s of device work, unless announced ahead.
    waits, gpu_share = {}, {}
    for prefetch in (False, True):
        pool = FleetSim(
            shard_s=60, startup_s=120, reclaim_per_hour=0.4, seed=5, charge_driver=False, prepare_s=10
        )
        events = Counts()
        config = DispatchConfig(min_actors=20, max_actors=20, idle_retire_s=60, tick_s=5.0, prefetch=prefetch)
        result = Dispatcher(_shards(1500), pool, config, events, pool.clock, keep_results=False).run()
        assert pool.reclaimed > 5 and result.committed == 1500 and not result.failed
        assert sorted(pool.manifests) == list(range(1500)) and set(pool.manifests.values()) == {1}
        assert events.committed == dict.fromkeys(range(1500), 1)
        assert (result.stats.prefetches > 0) is prefetch
        cost = pool.cost()
        waits[prefetch], gpu_share[prefetch] = pool.input_wait_s, cost.generating_s / cost.lifetime_s
    # Only each actor's first shard (and a reassigned one that starts at once) still waits.
    assert waits[True] < 0.1 * waits[False], waits
    assert gpu_share[True] > gpu_share[False] + 0.05, gpu_share
