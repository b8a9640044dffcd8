"""workers.prefetch: what run_shard gets from a prefetch, on real threads (the actor's prefetch
concurrency group is a thread beside run_shard's; tests/integration/test_prefetch.py runs it on Ray)."""

from __future__ import annotations

import threading
import time

import pytest

from ditfleet.workers.prefetch import PreparedShard, ShardPrefetch
from ditfleet.workers.rows import ShardSpec


def _shard(i: int) -> ShardSpec:
    return ShardSpec(i, "memory://prompts", i, i + 1, i, ("64x64",), 1)


class Prepare:
    """Prepares a shard in `seconds`, recording which shards it prepared on which thread."""

    def __init__(self, seconds: float = 0.0, fail_once: set[int] | None = None) -> None:
        self.seconds, self.fail_once = seconds, set(fail_once or ())
        self.calls: list[tuple[int, str]] = []

    def __call__(self, shard: ShardSpec) -> PreparedShard:
        self.calls.append((shard.index, threading.current_thread().name))
        time.sleep(self.seconds)
        if shard.index in self.fail_once:
            self.fail_once.discard(shard.index)
            raise OSError(f"input store unreachable for shard {shard.index}")
        return PreparedShard(rows=[], requests=[], inputs={"shard": shard.index})


def test_a_shard_prepared_ahead_is_taken_without_preparing_it_again():
    prepare = Prepare()
    ahead = ShardPrefetch(prepare)
    assert ahead.prefetch(_shard(1)) and not ahead.prefetch(_shard(1)), "announced twice: once"
    prepared, waited, prefetched = ahead.take(_shard(1))
    assert prefetched and prepared.inputs == {"shard": 1} and waited < 0.05
    assert [i for i, _ in prepare.calls] == [1]
    assert not ahead.prefetch(_shard(1)), "running: a late announcement prepares nothing"
    ahead.finished(_shard(1))
    # Not announced: prepared by run_shard itself.
    prepared, _, prefetched = ahead.take(_shard(2))
    assert not prefetched and prepared.inputs == {"shard": 2}


def test_run_shard_waits_for_a_prefetch_under_way_instead_of_reading_twice():
    prepare = Prepare(seconds=0.3)
    ahead = ShardPrefetch(prepare)
    thread = threading.Thread(target=ahead.prefetch, args=(_shard(4),), name="prefetch")
    thread.start()
    time.sleep(0.05)  # the prefetch is reading
    prepared, waited, prefetched = ahead.take(_shard(4))
    thread.join()
    assert prefetched and prepared.inputs == {"shard": 4} and 0.1 < waited < 0.3
    assert prepare.calls == [(4, "prefetch")]


def test_a_failed_prefetch_is_prepared_again_and_its_error_raised_by_run_shard():
    prepare = Prepare(fail_once={3})
    ahead = ShardPrefetch(prepare)
    assert ahead.prefetch(_shard(3))  # fails: nothing raised on the prefetch thread
    prepared, _, prefetched = ahead.take(_shard(3))
    assert not prefetched and prepared.inputs == {"shard": 3}
    prepare.fail_once = {5}
    ahead.prefetch(_shard(5))
    prepare.fail_once = {5}  # fails again when run_shard reads it: that error is the run's
    with pytest.raises(OSError, match="shard 5"):
        ahead.take(_shard(5))


def test_at_most_two_shards_are_held_and_one_never_started_is_dropped():
    prepare = Prepare()
    ahead = ShardPrefetch(prepare)
    # Shard 2 is announced before run_shard took shard 1: both are kept.
    ahead.prefetch(_shard(1))
    ahead.prefetch(_shard(2))
    assert ahead.take(_shard(1))[2] and ahead.take(_shard(2))[2] and ahead.dropped == 0
    # Shard 3's run moved elsewhere (never taken here); 4 and 5 were announced after it.
    for i in (3, 4, 5):
        ahead.prefetch(_shard(i))
    assert ahead.dropped == 1, "a third announcement drops the oldest: bounded"
    assert ahead.take(_shard(5))[2] and ahead.dropped == 2, "4 was announced before 5 and never ran"
    assert not ahead.take(_shard(3))[2], "dropped: prepared again if it does come"
