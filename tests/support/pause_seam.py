"""The pause test seam (INTEGRITY.md section 8), as the test processes use it.

A process started with `DITFLEET_PAUSE_AT=point[,point...]` and `DITFLEET_PAUSE_DIR=dir` that
reaches a named point writes `dir/<point>.<pid>` and stops itself with SIGSTOP; the test sees the
file, acts, then sends SIGCONT or SIGKILL (tests/support/paused_process.py). The driver's points
are the project's (`ditfleet.driver.output.pause_points`); the points of the test's own
processes (a stand-in worker before its commit) are here, with the same protocol.
"""

from __future__ import annotations

import os
import signal
import time

PAUSE_AT = "DITFLEET_PAUSE_AT"
PAUSE_DIR = "DITFLEET_PAUSE_DIR"


def _announce(name: str) -> str | None:
    """The pause file's path, written, when `$DITFLEET_PAUSE_AT` lists `name`; else None."""
    if name not in os.environ.get(PAUSE_AT, "").split(","):
        return None
    path = os.path.join(os.environ[PAUSE_DIR], f"{name}.{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    return path


def stop_point(name: str) -> None:
    """Write `$DITFLEET_PAUSE_DIR/<name>.<pid>` and SIGSTOP this process, when
    `$DITFLEET_PAUSE_AT` lists `name`; nothing otherwise."""
    if _announce(name) is not None:
        os.kill(os.getpid(), signal.SIGSTOP)


def hold_point(name: str) -> None:
    """Like a pause, but only the calling thread waits, until the test writes
    `<dir>/<name>.<pid>.go`: the rest of the process (the driver's lease renewals) runs on.
    For a stand-in worker inside a driver that must keep its lease while its shard waits."""
    path = _announce(name)
    while path is not None and not os.path.exists(path + ".go"):
        time.sleep(0.02)
