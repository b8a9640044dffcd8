"""Dispatch on a real local Ray, with real actors that sleep instead of generating.

The actors commit real manifests through the storage layer, so "every shard exactly once" is
checked on what is in the output directory, not on what the dispatcher believes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest

from ditfleet.driver.dispatch import DispatchConfig, DispatchEvents, run_shards
from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.output.manifest import committed_shards
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.dispatch_workers import SleepingWorker, SleepingWorkerConfig

pytestmark = pytest.mark.usefixtures("ray_cluster")


def make_shards(n: int, rows: int = 2) -> list[ShardSpec]:
    return [
        ShardSpec(i, "memory://prompts", i * rows, (i + 1) * rows, i * rows, ("64x64",), rows)
        for i in range(n)
    ]


class Recorder(DispatchEvents):
    def __init__(self) -> None:
        self.committed: list[int] = []
        self.retries: list[tuple[int, int]] = []
        self.lost: list[tuple[str, str, bool]] = []
        self.started: list[tuple[int, int, str, bool]] = []

    def shard_started(self, shard, attempt, worker_id, speculative):
        self.started.append((shard.index, attempt, worker_id, speculative))

    def shard_committed(self, shard, result):
        self.committed.append(shard.index)

    def shard_retry(self, shard, attempt, error):
        self.retries.append((shard.index, attempt))

    def actor_lost(self, worker_id, kind, error, starting):
        self.lost.append((kind, error, starting))


def manifest_attempts(out: str, shard: int) -> set[int]:
    table = read_parquet(open_store(out).get(manifest_key(shard)))
    return set(table.column("attempt").to_pylist())


def assert_each_once(out: str, n: int, result) -> None:
    assert committed_shards(open_store(out)) == set(range(n))
    counted = Counter(r.shard for r in result.results)
    assert counted == Counter(range(n)), "each shard must be counted exactly once"


def test_pull_scheduling_gives_more_work_to_the_faster_actor(tmp_path):
    out, markers = str(tmp_path / "out"), tmp_path / "markers"
    markers.mkdir()
    # The slow actor starts first; the fast one may start seconds later on a busy machine, and
    # at 2 s a shard the slow one takes only a few meanwhile.
    worker = SleepingWorkerConfig(out, shard_s=0.02, slow_first_actor_s=2.0, marker_dir=str(markers))
    config = DispatchConfig(min_actors=2, max_actors=2, num_cpus=0.5, speculative_tail=False, tick_s=0.1)
    result = run_shards(make_shards(30), SleepingWorker, (worker,), config)
    assert_each_once(out, 30, result)
    by_worker = Counter(r.worker_id for r in result.results)
    slow = sum(n for w, n in by_worker.items() if w.endswith("-slow"))
    fast = sum(n for w, n in by_worker.items() if not w.endswith("-slow"))
    assert len(by_worker) == 2 and fast >= 4 * slow, by_worker
    assert result.failed == [] and result.stats.retries == 0
    assert result.stats.actors_started == 2 and result.stats.actors_ready == 2


def test_actor_killed_mid_shard_is_replaced_and_its_shard_rerun(tmp_path):
    out, pids = str(tmp_path / "out"), tmp_path / "pids"
    pids.mkdir()
    # Enough work that shards still wait when the death is noticed: then a replacement starts.
    # The hang is far longer than the bound below: a busy machine's slow start-ups pass, a
    # dispatcher that waits for the killed actor's shard does not.
    worker = SleepingWorkerConfig(out, shard_s=0.1, hang={3: 600.0}, pid_dir=str(pids))
    config = DispatchConfig(min_actors=2, max_actors=2, num_cpus=0.5, speculative_tail=False, tick_s=0.1)
    killed: list[int] = []
    finished = threading.Event()

    def kill_when_hanging() -> None:
        # No deadline of its own: under load (a coverage run traces every actor) shard 3 may start
        # minutes in. The killer gives up only when the dispatch ended without it.
        path = pids / "3.pid"
        while not path.exists():
            if finished.wait(0.05):
                return
        pid = int(path.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_when_hanging, daemon=True)
    killer.start()
    events = Recorder()
    t0 = time.monotonic()
    result = run_shards(make_shards(30), SleepingWorker, (worker,), config, events)
    finished.set()
    killer.join(timeout=5)
    assert killed, "the hanging shard never started"
    assert time.monotonic() - t0 < 200, "the shard on the killed actor must not wait for its hang"
    assert_each_once(out, 30, result)
    assert manifest_attempts(out, 3) == {1}, "the rerun after the death is attempt 1"
    assert result.stats.actor_deaths == 1 and result.stats.actors_started >= 3
    assert [k for k, _, starting in events.lost] == ["actor_died"]
    assert (3, 1) in events.retries


def test_shard_failing_max_attempts_is_reported_and_the_job_goes_on(tmp_path):
    out = str(tmp_path / "out")
    # shard 2 always raises; shard 5 raises once then succeeds.
    worker = SleepingWorkerConfig(out, shard_s=0.03, fail={2: -1, 5: 1})
    # No tail moves: a retry moved to an idle actor after it started would run twice under one
    # attempt number, and both runs count as failed attempts (see DispatchConfig.max_attempts),
    # so which attempt failed last would depend on timing.
    config = DispatchConfig(
        min_actors=2, max_actors=2, num_cpus=0.5, max_attempts=3, speculative_tail=False, tick_s=0.1
    )
    events = Recorder()
    result = run_shards(make_shards(10), SleepingWorker, (worker,), config, events)
    assert committed_shards(open_store(out)) == set(range(10)) - {2}
    assert [f.index for f in result.failed] == [2]
    failure = result.failed[0]
    assert failure.attempts == 3 and failure.kind == "RuntimeError"
    assert "injected failure of shard 2 attempt 2" in failure.error
    assert manifest_attempts(out, 5) == {1}
    assert sorted(r.shard for r in result.results) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(a for s, a in events.retries if s == 2) == [1, 2]


def test_tail_moves_queued_shards_and_duplicates_a_straggler(tmp_path):
    out = str(tmp_path / "out")
    # Shard 0 hangs on its first attempt; shard 2 is queued behind it on the same actor.
    # The hang is far longer than the bound below (a busy machine's start-ups pass it).
    worker = SleepingWorkerConfig(out, shard_s=0.05, hang={0: 600.0})
    config = DispatchConfig(
        min_actors=2, max_actors=2, num_cpus=0.5, speculative_after=2.0, idle_retire_s=60, tick_s=0.05
    )
    events = Recorder()
    t0 = time.monotonic()
    result = run_shards(make_shards(8), SleepingWorker, (worker,), config, events)
    assert time.monotonic() - t0 < 200, "the straggler's second run must finish the job"
    assert_each_once(out, 8, result)
    assert result.stats.tail_moves >= 1
    assert result.stats.speculative_runs == 1 and result.stats.speculative_wins == 1
    assert manifest_attempts(out, 0) == {1}
    speculative = [(s, a) for s, a, _, spec in events.started if spec]
    assert (0, 1) in speculative


def test_actors_that_fail_to_start_stop_the_job_with_the_cause(tmp_path):
    from ditfleet.driver.dispatch import DispatchError

    config = DispatchConfig(min_actors=1, max_actors=2, num_cpus=0.5, max_start_failures=2, tick_s=0.1)
    with pytest.raises(DispatchError) as err:
        run_shards(make_shards(3), SleepingWorker, ("not a config",), config)
    text = str(err.value)
    assert "2 worker actors in a row failed to start" in text
    assert "AttributeError" in text and "output_uri" in text, text


def test_idle_actors_retire_when_nothing_is_queued(tmp_path):
    out = str(tmp_path / "out")
    # One long shard keeps the job alive after the queue empties; the other actors go idle.
    worker = SleepingWorkerConfig(out, shard_s=0.02, hang={0: 1.5})
    config = DispatchConfig(
        min_actors=3, max_actors=3, num_cpus=0.5, speculative_tail=False, idle_retire_s=0.3, tick_s=0.05
    )
    retired: list[str] = []

    class Events(DispatchEvents):
        def actor_retired(self, worker_id):
            retired.append(worker_id)

    result = run_shards(make_shards(4), SleepingWorker, (worker,), config, Events())
    assert_each_once(out, 4, result)
    assert result.stats.actors_retired >= 1 and len(retired) == result.stats.actors_retired
    # A retired actor was stopped on purpose: not a death, and nothing of it runs again.
    assert (result.stats.actor_deaths, result.stats.retries, result.stats.speculative_runs) == (0, 0, 0)


def test_a_worker_that_abandons_its_shard_is_let_go_and_the_shard_rerun_without_an_attempt(tmp_path):
    out = str(tmp_path / "out")
    # The actor raises workers.contract.ShardAbandoned (as one asked to stop does): Ray hands the
    # driver a RayTaskError that must be recognised as that type. max_attempts=1: were it counted
    # as a failed run, shard 1 would be reported failed.
    worker = SleepingWorkerConfig(out, shard_s=0.03, abandon={1: 1})
    # No tail moves: a speculative twin of the rerun would take the next attempt number.
    config = DispatchConfig(
        min_actors=2, max_actors=2, num_cpus=0.5, max_attempts=1, speculative_tail=False, tick_s=0.1
    )
    events = Recorder()
    result = run_shards(make_shards(6), SleepingWorker, (worker,), config, events)
    assert_each_once(out, 6, result)
    assert result.failed == [] and result.stats.retries == 0 and events.retries == []
    assert [kind for kind, _, _ in events.lost] == ["stopping"]
    assert "ShardAbandoned" in events.lost[0][1]
    assert manifest_attempts(out, 1) == {1}
