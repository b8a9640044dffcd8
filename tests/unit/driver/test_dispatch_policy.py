"""The dispatch policy's decisions, on a simulated pool of actors and a simulated clock.

`SimPool` is an `ActorPool` whose actors run their queued calls one at a time, in order, in
simulated time: each run takes what the test's script says and ends as it says (a result, a
raised error, the actor's death, the worker leaving). Its first-commit-wins rule is the
manifest's: a second commit of a shard returns "already_committed". No Ray, no sleeping: each
test runs in milliseconds. The same policy on a real Ray cluster is tested in test_dispatch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import pytest

from ditfleet.driver.dispatch import DispatchConfig, DispatchError, DispatchEvents
from ditfleet.driver.dispatch.policy import Dispatcher
from ditfleet.driver.dispatch.slots import ACTOR_DIED, CANCELLED, LEAVING, RAISED, ActorPool, RunError, Slot
from ditfleet.workers.contract import ShardResult
from ditfleet.workers.rows import ShardSpec
from tests.support.paths import REPO

ROOT = REPO

# What a run does: (seconds, outcome); outcome "ok", "raise", "die" (its actor dies) or "leave".
Script = Callable[[int, int], tuple[float, str]]


def steady(seconds: float = 1.0) -> Script:
    return lambda shard, attempt: (seconds, "ok")


@dataclass
class SimRun:
    ref: int
    actor: int
    shard: ShardSpec
    attempt: int
    seconds: float
    outcome: str
    ends_at: float | None = None  # set when it starts (reaches the head of its actor's queue)
    result: ShardResult | RunError | None = None


@dataclass
class SimActor:
    id: int
    ready_at: float | None  # None: never placed
    fails_to_start: bool = False
    queue: list[SimRun] = field(default_factory=list)
    dead: bool = False


class SimPool(ActorPool):
    def __init__(
        self,
        script: Script,
        startup_s: float = 1.0,
        start_failures: int = 0,
        placeable: bool = True,
        slowdown: dict[int, float] | None = None,  # actor -> factor on its run times
    ):
        super().__init__()
        self.now = 0.0
        self.script = script
        self.slowdown = slowdown or {}
        self.startup_s, self.start_failures, self.placeable = startup_s, start_failures, placeable
        self.actors: dict[int, SimActor] = {}
        self.actor_ids, self.run_ids = count(), count()
        self.done: dict[Hashable, object] = {}  # ref -> result or RunError (or a startup report)
        self.committed: set[int] = set()  # the manifests
        self.log: list[tuple[int, int, int, str]] = []  # (shard, attempt, actor, outcome) of ended runs
        self.startups: dict[Hashable, int] = {}
        # (actor, shard, time, its place in the actor's queue then) of each announced prefetch
        self.prefetched: list[tuple[int, int, float, int]] = []

    def clock(self) -> float:
        return self.now

    # -- the pool's mechanics, simulated -----------------------------------------------------------

    def _create(self) -> tuple[int, Hashable]:
        actor = SimActor(next(self.actor_ids), self.now + self.startup_s if self.placeable else None)
        actor.fails_to_start = self.start_failures > 0
        self.start_failures -= 1
        self.actors[actor.id] = actor
        ref = ("startup", actor.id)
        self.startups[ref] = actor.id
        return actor.id, ref

    def _kill(self, slot: Slot) -> None:
        self._die(self.actors[slot.handle])

    def submit(self, slot: Slot, shard: ShardSpec, attempt: int) -> Hashable:
        actor = self.actors[slot.handle]
        seconds, outcome = self.script(shard.index, attempt)
        seconds *= self.slowdown.get(actor.id, 1.0)
        run = SimRun(next(self.run_ids), actor.id, shard, attempt, seconds, outcome)
        actor.queue.append(run)
        self._start_head(actor, self.now)
        return run.ref

    def prefetch(self, slot: Slot, shard: ShardSpec) -> None:
        actor = self.actors[slot.handle]
        place = next(i for i, run in enumerate(actor.queue) if run.shard.index == shard.index)
        self.prefetched.append((actor.id, shard.index, self.now, place))

    def cancel(self, ref: Hashable) -> None:
        for actor in self.actors.values():
            for i, run in enumerate(actor.queue):
                if run.ref == ref and i > 0:  # a running call is not interrupted
                    del actor.queue[i]
                    self.done[ref] = RunError(CANCELLED, "TaskCancelledError", "cancelled")
                    return

    def wait(self, refs: Sequence[Hashable], timeout_s: float) -> list[Hashable]:
        """Advance to the first event among `refs` (at most timeout_s), then report all done."""
        until = self.now + timeout_s
        while not any(r in self.done for r in refs):
            nxt = self._next_event()
            if nxt is None or nxt > until:
                self.now = until
                return []
            self._advance(nxt)
        return [r for r in refs if r in self.done]

    def startup_outcome(self, slot: Slot) -> dict | RunError:
        return self.done.pop(slot.startup_ref)

    def run_outcome(self, ref: Hashable) -> ShardResult | RunError:
        return self.done.pop(ref)

    # -- simulated time --------------------------------------------------------------------------

    def _next_event(self) -> float | None:
        starting = [self.actors[a].ready_at for a in self.startups.values()]
        times = [t for t in starting if t is not None]
        times += [a.queue[0].ends_at for a in self.actors.values() if a.queue and not a.dead]
        return min(times) if times else None

    def _advance(self, t: float) -> None:
        self.now = t
        for ref, actor_id in list(self.startups.items()):
            actor = self.actors[actor_id]
            if actor.ready_at == t and not actor.dead:
                del self.startups[ref]
                failed = RunError(RAISED, "ActorDiedError", "ActorDiedError: creation task failed: boom")
                self.done[ref] = failed if actor.fails_to_start else {"worker_id": f"w{actor_id}"}
        for actor in list(self.actors.values()):
            if actor.queue and not actor.dead and actor.queue[0].ends_at == t:
                self._finish_head(actor)

    def _start_head(self, actor: SimActor, t: float) -> None:
        if actor.queue and actor.queue[0].ends_at is None:
            actor.queue[0].ends_at = t + actor.queue[0].seconds

    def _finish_head(self, actor: SimActor) -> None:
        run = actor.queue.pop(0)
        self.log.append((run.shard.index, run.attempt, actor.id, run.outcome))
        if run.outcome == "die":
            actor.queue.insert(0, run)
            self._die(actor)
            return
        if run.outcome == "raise":
            self.done[run.ref] = RunError(RAISED, "RuntimeError", f"RuntimeError: shard {run.shard.index}")
        elif run.outcome == "leave":
            self.done[run.ref] = RunError(LEAVING, "ShardAbandoned", "ShardAbandoned: asked to stop")
        else:
            status = "already_committed" if run.shard.index in self.committed else "committed"
            self.committed.add(run.shard.index)
            self.done[run.ref] = ShardResult(
                run.shard.index, run.attempt, status, wall_s=run.seconds, worker_id=f"w{actor.id}"
            )
        self._start_head(actor, self.now)

    def _die(self, actor: SimActor) -> None:
        if actor.dead:
            return
        actor.dead = True
        for run in actor.queue:
            self.done[run.ref] = RunError(ACTOR_DIED, "actor_died", "ActorDiedError: the actor died")
        actor.queue.clear()
        for ref, actor_id in list(self.startups.items()):
            if actor_id == actor.id:
                del self.startups[ref]


class Recorder(DispatchEvents):
    def __init__(self) -> None:
        self.started: list[tuple[int, int, str, bool]] = []
        self.retries: list[tuple[int, int]] = []
        self.lost: list[tuple[str, str, bool]] = []
        self.committed: list[int] = []

    def shard_started(self, shard, attempt, worker_id, speculative):
        self.started.append((shard.index, attempt, worker_id, speculative))

    def shard_retry(self, shard, attempt, error):
        self.retries.append((shard.index, attempt))

    def actor_lost(self, worker_id, kind, error, starting):
        self.lost.append((worker_id, kind, starting))

    def shard_committed(self, shard, result):
        self.committed.append(shard.index)


def shards(n: int) -> list[ShardSpec]:
    return [ShardSpec(i, "memory://prompts", i, i + 1, i, ("64x64",), 1) for i in range(n)]


def dispatch(pool: SimPool, n: int, events: DispatchEvents | None = None, **config):
    config = {"min_actors": 2, "max_actors": 2, "speculative_tail": False, **config}
    return Dispatcher(shards(n), pool, DispatchConfig(**config), events or Recorder(), pool.clock).run()


def counted_once(result, n: int) -> bool:
    return sorted(r.shard for r in result.results) == list(range(n))


def test_pull_gives_more_shards_to_the_faster_actor():
    pool = SimPool(steady(), slowdown={0: 5.0})
    result = dispatch(pool, 30)
    assert counted_once(result, 30) and not result.failed
    by_worker = {w: sum(1 for r in result.results if r.worker_id == w) for w in ("w0", "w1")}
    assert by_worker["w1"] >= 3 * by_worker["w0"], by_worker


def test_a_failing_shard_is_retried_up_to_max_attempts_then_reported():
    fails = {2: 99, 5: 1}  # shard 2 always raises; shard 5 raises once
    pool = SimPool(lambda shard, attempt: (1.0, "raise" if attempt < fails.get(shard, 0) else "ok"))
    events = Recorder()
    result = dispatch(pool, 10, events, max_attempts=3)
    assert [(f.index, f.attempts, f.kind) for f in result.failed] == [(2, 3, "RuntimeError")]
    assert sorted(r.shard for r in result.results) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert [r.attempt for r in result.results if r.shard == 5] == [1]
    assert sorted(a for s, a in events.retries if s == 2) == [1, 2] and (5, 1) in events.retries
    assert result.stats.retries == 3


def test_two_failures_in_a_row_replace_the_actor():
    # Shard 0 fails twice on the one actor (a retry goes to the front of the queue).
    pool = SimPool(lambda shard, attempt: (1.0, "raise" if shard == 0 and attempt < 2 else "ok"))
    events = Recorder()
    result = dispatch(pool, 6, events, min_actors=1, max_actors=1, shards_in_flight_per_actor=1)
    assert counted_once(result, 6) and not result.failed
    assert [r.worker_id for r in result.results if r.shard == 0] == ["w1"]
    assert result.stats.actors_replaced == 1 and result.stats.actors_started == 2
    assert ("w0", "replaced", False) in events.lost


def test_a_leaving_actor_requeues_its_shard_without_using_an_attempt():
    # max_attempts=1: a counted attempt would fail the shard outright.
    pool = SimPool(lambda shard, attempt: (1.0, "leave" if shard == 3 and attempt == 0 else "ok"))
    events = Recorder()
    result = dispatch(pool, 8, events, max_attempts=1)
    assert counted_once(result, 8) and not result.failed
    assert result.stats.retries == 0 and not events.retries
    assert [kind for _, kind, _ in events.lost] == ["stopping"]
    assert result.stats.actor_deaths == 1 and result.stats.actors_started == 3  # replaced


def test_a_dead_actor_fails_its_running_shard_and_requeues_the_queued_one_as_it_was():
    # Shard 0 kills its actor; shard 2 was queued behind it there and never started.
    pool = SimPool(lambda shard, attempt: (1.0, "die" if shard == 0 and attempt == 0 else "ok"))
    events = Recorder()
    result = dispatch(pool, 8, events)
    assert counted_once(result, 8) and not result.failed
    assert [r.attempt for r in result.results if r.shard == 0] == [1]  # the death used attempt 0
    assert [r.attempt for r in result.results if r.shard == 2] == [0]  # never ran: keeps attempt 0
    assert events.retries == [(0, 1)] and [kind for _, kind, _ in events.lost] == ["actor_died"]
    assert result.stats.actor_deaths == 1


def test_a_straggler_gets_a_speculative_twin_and_the_first_commit_wins():
    pool = SimPool(lambda shard, attempt: (100.0 if (shard, attempt) == (0, 0) else 1.0, "ok"))
    events = Recorder()
    result = dispatch(pool, 8, events, speculative_tail=True, speculative_after=2.0, idle_retire_s=1000)
    assert counted_once(result, 8)
    assert result.stats.speculative_runs == 1 and result.stats.speculative_wins == 1
    assert [r.attempt for r in result.results if r.shard == 0] == [1]
    assert (0, 1, True) in [(s, a, spec) for s, a, _, spec in events.started]
    assert result.wall_s < 20, "the twin, not the 100 s original, must finish the job"


def test_both_twins_commit_and_the_shard_is_counted_once():
    # Shard 0's original takes 8 s, its twin 7 s from a few seconds later: the original commits
    # first and the twin's commit finds the manifest. Shard 7 (30 s) keeps the job going meanwhile.
    slow = {(0, 0): 8.0, (0, 1): 7.0, (7, 0): 30.0, (7, 1): 30.0}
    pool = SimPool(lambda shard, attempt: (slow.get((shard, attempt), 1.0), "ok"))
    events = Recorder()
    result = dispatch(
        pool, 8, events, min_actors=3, max_actors=3, speculative_tail=True, speculative_after=2.0,
        idle_retire_s=1000,
    )  # fmt: skip
    assert counted_once(result, 8)
    assert [(s, a) for s, a, _, spec in events.started if spec] == [(0, 1), (7, 1)]
    assert [r.attempt for r in result.results if r.shard in (0, 7)] == [0, 0]
    assert (0, 1, 1, "ok") in pool.log, "the twin ran to its end"
    assert result.stats.duplicate_results == 1 and result.stats.speculative_wins == 0


def test_a_run_queued_behind_a_straggler_moves_to_an_idle_actor_keeping_its_attempt():
    # Shard 0 runs 50 s on actor 0 with shard 2 queued behind it; actor 1 runs out of work.
    pool = SimPool(lambda shard, attempt: (50.0 if shard == 0 else 1.0, "ok"))
    events = Recorder()
    result = dispatch(pool, 4, events, speculative_tail=True, speculative_after=1000.0, idle_retire_s=1000)
    assert counted_once(result, 4)
    assert result.stats.tail_moves == 1
    assert [r.attempt for r in result.results if r.shard == 2] == [0]
    assert [r.worker_id for r in result.results if r.shard == 2] == ["w1"]
    assert (2, 0, 0, "ok") not in pool.log, "the queued original was cancelled before it started"


def test_the_run_queued_behind_the_executing_one_is_announced_one_ahead():
    pool = SimPool(lambda shard, attempt: (1.0 + shard % 3, "ok"))
    result = dispatch(pool, 12, shards_in_flight_per_actor=3)
    assert counted_once(result, 12) and not result.failed
    # Every announcement is of the run right behind the executing one, never further back...
    assert pool.prefetched and {place for *_, place in pool.prefetched} == {1}
    # ...once per run, and every shard that waited behind another on its actor was announced
    # while the one before it ran: all but the first two (each actor's first run starts at once).
    announced = [shard for _, shard, _, _ in pool.prefetched]
    assert len(announced) == len(set(announced)) == result.stats.prefetches == 10
    assert sorted(announced) == list(range(2, 12))
    pool = SimPool(lambda shard, attempt: (1.0 + shard % 3, "ok"))
    unannounced = dispatch(pool, 12, shards_in_flight_per_actor=3, prefetch=False)
    assert counted_once(unannounced, 12) and not pool.prefetched and unannounced.stats.prefetches == 0
    # One run per actor at a time: nothing is queued behind, nothing to announce.
    pool = SimPool(steady())
    assert dispatch(pool, 6, shards_in_flight_per_actor=1).stats.prefetches == 0 and not pool.prefetched


def test_a_prefetched_shard_of_a_lost_actor_is_reassigned_keeping_its_attempt():
    # Shard 0 kills actor 0, where shard 2 was queued and announced (its rows read ahead there).
    pool = SimPool(lambda shard, attempt: (1.0, "die" if shard == 0 and attempt == 0 else "ok"))
    events = Recorder()
    result = dispatch(pool, 8, events)
    assert (0, 2, 1) in [(a, s, place) for a, s, _, place in pool.prefetched], "announced to actor 0"
    assert counted_once(result, 8) and not result.failed
    [two] = [r for r in result.results if r.shard == 2]
    assert two.attempt == 0 and two.worker_id != "w0", "never started there: reassigned as it was"
    assert [(s, a) for s, a, *_ in pool.log if s == 2] == [(2, 0)], "run once, by another actor"
    # Announced again on its new actor, where it queued behind another run.
    assert [actor for actor, shard, *_ in pool.prefetched if shard == 2] == [0, 1]


def test_a_prefetched_run_moved_to_an_idle_actor_runs_once_there():
    # Shard 2 is queued (and announced) behind a 50 s shard 0 on actor 0; actor 1 runs dry.
    pool = SimPool(lambda shard, attempt: (50.0 if shard == 0 else 1.0, "ok"))
    result = dispatch(pool, 4, speculative_tail=True, speculative_after=1000.0, idle_retire_s=1000)
    assert (0, 2, 1) in [(a, s, place) for a, s, _, place in pool.prefetched]
    assert counted_once(result, 4) and result.stats.tail_moves == 1
    assert [(r.attempt, r.worker_id) for r in result.results if r.shard == 2] == [(0, "w1")]
    assert [(s, actor) for s, _, actor, _ in pool.log if s == 2] == [(2, 1)]


def test_a_shard_over_its_timeout_stops_its_actor_and_counts_an_attempt():
    pool = SimPool(lambda shard, attempt: (100.0 if (shard, attempt) == (1, 0) else 1.0, "ok"))
    events = Recorder()
    result = dispatch(pool, 4, events, shard_timeout_s=10.0)
    assert counted_once(result, 4)
    assert [r.attempt for r in result.results if r.shard == 1] == [1]
    assert ("w1", "shard_timeout", False) in events.lost and (1, 1) in events.retries
    assert result.wall_s < 20


def test_actors_failing_to_start_in_a_row_stop_the_job_with_the_cause():
    pool = SimPool(steady(), start_failures=5)
    with pytest.raises(DispatchError, match=r"2 worker actors in a row failed to start.*task failed"):
        dispatch(pool, 3, min_actors=1, max_actors=1, max_start_failures=2)


def test_a_start_failure_is_replaced_and_the_job_goes_on():
    pool = SimPool(steady(), start_failures=1)
    events = Recorder()
    result = dispatch(pool, 4, events, min_actors=1, max_actors=1)
    assert counted_once(result, 4)
    assert result.stats.start_failures == 1 and events.lost == [("actor-0", "ActorDiedError", True)]


def test_no_actor_placed_within_the_placement_timeout_stops_the_job():
    pool = SimPool(steady(), placeable=False)
    with pytest.raises(DispatchError, match=r"no worker actor became ready in 6\d s while 3 shards waited"):
        dispatch(pool, 3, placement_timeout_s=60.0)


def test_the_pool_grows_to_max_while_shards_wait_but_not_past_the_queue():
    pool = SimPool(steady())
    result = dispatch(pool, 40, min_actors=1, max_actors=4)
    assert counted_once(result, 40) and result.stats.actors_started == 4
    pool = SimPool(steady())
    result = dispatch(pool, 2, min_actors=1, max_actors=8, shards_in_flight_per_actor=1)
    assert counted_once(result, 2) and result.stats.actors_started == 2


def test_idle_actors_retire_when_nothing_is_queued():
    pool = SimPool(lambda shard, attempt: (30.0 if shard == 0 else 1.0, "ok"))
    result = dispatch(pool, 4, min_actors=3, max_actors=3, idle_retire_s=5.0)
    assert counted_once(result, 4)
    assert result.stats.actors_retired == 2


def test_dispatch_types_progress_metrics_and_summary_load_no_ray():
    code = (
        "import json, sys; import driver.dispatch, driver.progress, driver.metrics, driver.output.summary; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tops = {m.split(".")[0] for m in json.loads(proc.stdout.splitlines()[-1])}
    assert "ray" not in tops and "torch" not in tops
