"""The output lease: a crashed driver on the same machine does not block the next run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ditfleet.driver.output.lease import OutputBusy, _process_space, acquire_lease
from ditfleet.workers.output.layout import lease_key
from ditfleet.workers.storage import open_store


def _plant(store, pid: int) -> None:
    doc = {
        "owner": "other",
        "host": "here",
        "pid": pid,
        "process_space": _process_space(),
        "acquired_at": "2026-01-01T00:00:00Z",
        "expires_at": time.time() + 120,
        "released": False,
    }
    store.put_if_absent(lease_key(0), json.dumps(doc).encode(), "application/json")


@pytest.mark.skipif(_process_space() is None, reason="needs /proc")
def test_a_lease_whose_driver_process_is_gone_is_taken_at_once(tmp_path):
    store = open_store(str(tmp_path / "out"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant(store, dead.pid)
    lease = acquire_lease(store, renew=False)
    assert lease.generation == 1
    lease.release()


@pytest.mark.skipif(_process_space() is None, reason="needs /proc")
def test_a_lease_whose_driver_is_alive_is_refused(tmp_path):
    store = open_store(str(tmp_path / "out"))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _plant(store, alive.pid)
        with pytest.raises(OutputBusy, match="being written by another"):
            acquire_lease(store, renew=False)
    finally:
        alive.kill()
        alive.wait()


def test_older_generations_stay_until_settled_and_the_document_says_what_its_run_does(tmp_path):
    store = open_store(str(tmp_path / "out"))
    t0 = time.time()
    first = acquire_lease(store, ttl_s=60, renew=False, clock=lambda: t0)
    first.record_work([0, 1, 2, 9], {1: 2})
    # Its driver stops renewing (paused past its lease): another takes the output after 60 s.
    second = acquire_lease(store, ttl_s=60, renew=False, clock=lambda: t0 + 61)
    assert store.exists(lease_key(0)) and store.exists(lease_key(1))  # not deleted on acquire
    doc = json.loads(store.get(lease_key(0)))
    assert doc["shards"] == [[0, 2], [9, 9]] and doc["redo"] == {"1": 2} and doc["settled"] is False
    with pytest.raises(OutputBusy, match="another driver took the output"):
        first.record_work([3], {})  # a paused holder that lost the output learns it here
    second.mark_settled()
    second.release()
    assert json.loads(store.get(lease_key(1)))["settled"] is True


def test_a_pause_point_stops_the_process_only_when_named(tmp_path):
    import os
    import signal

    from ditfleet.driver.output.pause_points import pause_point

    pause_point("in_cleanup")  # unset: nothing happens
    with pytest.raises(ValueError, match="unknown pause point"):
        pause_point("nowhere")
    env = {
        **os.environ,
        "DITFLEET_PAUSE_AT": "before_success, in_cleanup",
        "DITFLEET_PAUSE_DIR": str(tmp_path),
    }
    code = "from ditfleet.driver.output.pause_points import pause_point; pause_point('in_cleanup'); print('resumed')"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        marker = tmp_path / f"in_cleanup.{proc.pid}"
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists()
        time.sleep(0.2)
        assert proc.poll() is None  # stopped, not exited
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.communicate(timeout=60)[0].strip() == "resumed" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
