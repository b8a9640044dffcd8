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
