"""A test seam for pauses: named points where a test can freeze this process with SIGSTOP.

    pause_point("in_cleanup")

When the environment variable DITFLEET_PAUSE_AT lists the name (comma-separated), the process
writes the file `$DITFLEET_PAUSE_DIR/<name>.<pid>` and stops itself (SIGSTOP); the test sees the
file, does what it wants meanwhile (takes the output over, runs a redo) and sends SIGCONT or
SIGKILL. With the variable unset it does nothing. The rules of docs/reliability.md hold under a
pause of any length at any point; these names are where the tests of tests/integration pause.

POINTS names them and where the code calls them.
"""

from __future__ import annotations

import os
import signal

PAUSE_AT_ENV = "DITFLEET_PAUSE_AT"
PAUSE_DIR_ENV = "DITFLEET_PAUSE_DIR"
POINTS = {
    "after_lease_check": "driver finish: the lease was just checked, before the clean-up",
    "in_cleanup": "driver finish: manifests read and lost objects computed, before deleting",
    "before_success": "driver finish: clean-up done, before `_SUCCESS` is written",
    "after_redo_commit": "driver finish: dispatch returned (redo generations committed), before supersession",
    "verify_before_delete": "`verify --clean`: manifests read, before deleting",
    "after_dispatch_start": "driver: the lease document with its shards and redo generations is written "
    "and the first shard was handed to an actor",
    "compact_before_write": "compaction: the new set is built locally, before anything is written",
    "compact_after_lease_check": "compaction: the new set is built and the lease was just checked, before it is written",
    "compact_before_index": "compaction: the new set is written, before its index",
}


def pause_point(name: str) -> None:
    """Stop this process here when DITFLEET_PAUSE_AT names `name` (see the module docstring)."""
    if name not in POINTS:
        raise ValueError(f"unknown pause point {name!r}; the points are {tuple(POINTS)}")
    wanted = os.environ.get(PAUSE_AT_ENV)
    if not wanted or name not in {w.strip() for w in wanted.split(",")}:
        return
    directory = os.environ.get(PAUSE_DIR_ENV) or "."
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.{os.getpid()}"), "w") as f:
        f.write(f"{os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGSTOP)
