"""Actors starting together on one machine compile each bucket once (compile.claims)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ditfleet.compile import BucketClaims, CompileClaimWarning
from ditfleet.testing.prewarm import spawn_prewarm
from tests.support.compile_helpers import SMALL_BUCKETS

QUIET_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _hold_in_child(claims: BucketClaims, bucket: str) -> subprocess.Popen:
    """Another process that claims `bucket` and then sits on it until killed."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from ditfleet.compile.claims import BucketClaims
        fd = BucketClaims({str(claims.dir.parent)!r}, {claims.key!r}, 1).try_claim({bucket!r})
        print("held" if fd is not None else "busy", flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_free_bucket_is_claimed_and_a_held_one_is_not(tmp_path):
    claims = BucketClaims(tmp_path, "key-a", timeout_s=5)
    fd = claims.try_claim("32x32")
    assert fd is not None
    with claims.hold("32x32", fd) as outcome:
        assert outcome.how == "claimed"
    # Per key and bucket: another key or another bucket is a different lock.
    assert BucketClaims(tmp_path, "key-b", 5).path("32x32") != claims.path("32x32")
    assert claims.path("48x32") != claims.path("32x32")
    with pytest.raises(ValueError, match="claim timeout"):
        BucketClaims(tmp_path, "k", 0)


def test_a_waiter_whose_claimant_dies_takes_over_at_once(tmp_path):
    claims = BucketClaims(tmp_path, "key", timeout_s=60)
    child = _hold_in_child(claims, "32x32")
    try:
        assert claims.try_claim("32x32") is None
        threading_start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: _wait_and_hold(claims, "32x32"))
            time.sleep(1.0)
            assert not waiting.done()  # the claimant is alive: the waiter waits
            child.kill()  # dies mid-compile: the kernel drops its lock
            outcome = waiting.result(timeout=30)
        assert outcome.how == "waited"  # it holds the lock now and compiles the bucket itself
        assert 1.0 <= outcome.waited_s < time.monotonic() - threading_start + 0.1
        assert outcome.waited_s < 30
    finally:
        child.kill()
        child.wait()


def test_a_waiter_whose_claimant_hangs_compiles_after_the_timeout_loudly(tmp_path):
    claims = BucketClaims(tmp_path, "key", timeout_s=1.5)
    child = _hold_in_child(claims, "48x32")
    try:
        with pytest.warns(CompileClaimWarning, match="48x32.*compiling it here as well"):
            outcome = _wait_and_hold(claims, "48x32")
        assert outcome.how == "timeout" and 1.5 <= outcome.waited_s < 10
    finally:
        child.kill()
        child.wait()


def _wait_and_hold(claims: BucketClaims, bucket: str):
    with claims.hold(bucket) as outcome:
        return outcome


@pytest.mark.slow
def test_two_processes_starting_together_compile_each_bucket_once(random_model_dir, tmp_path):
    """Two fresh processes sharing one empty local Inductor cache warm the same bucket at once:
    its graphs are compiled by exactly one of them, and the other loads them from the local cache
    (0 Inductor compiles) after waiting or claiming it after the fact. One bucket: a second one
    would cost another cold compile to show what the lock tests above show without one, that each
    bucket is its own lock."""
    inductor = tmp_path / "inductor"
    buckets = [SMALL_BUCKETS[0].name]
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(
                spawn_prewarm, random_model_dir, buckets, tmp_path / "store", inductor, extra_env=QUIET_ENV
            )
            for _ in range(2)
        ]
        results = [r.result() for r in runs]
    for bucket in buckets:
        per_process = [next(b for b in r["buckets"] if b["bucket"] == bucket) for r in results]
        compiled = [b for b in per_process if b["inductor_compiles"] > 0]
        assert len(compiled) == 1, f"bucket {bucket} compiled by {len(compiled)} processes: {per_process}"
        assert compiled[0]["claim"] == "claimed"
        assert all(b["claim"] in ("claimed", "waited") for b in per_process)
    # Each process still traced every bucket itself (its own guards: no request compiles later).
    assert all(r["compiles"] >= len(buckets) for r in results)
    print(f"\nclaims: {[r['buckets'] for r in results]}; warm-up {[r['warmup_s'] for r in results]} s")
