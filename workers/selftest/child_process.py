"""An isolated stage's child process (runner.run_isolated): the same command with `--child-stage
NAME`, its JSON lines relayed as they come, and at the stage's deadline the child and everything
it started (Inductor's compile workers) ended.

The child's clock starts when it says it has started the stage (CHILD_STARTED, on stdout), so a
slow start (imports, CUDA's first context) is not taken from the stage. The start itself gets
CHILD_START_S; the stage then gets its limit plus CHILD_GRACE_S, the chance to stop at its own
next check with a `deadline` line before it is ended. The child is handed the plain numbers of
this process's state (`child_facts`), which its lines are compared with.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ditfleet.selftest")

CHILD_STARTED = "selftest-child: stage started"
CHILD_START_S = 120.0
CHILD_GRACE_S = 5.0

Line = dict[str, Any]


def run_child_process(
    command: list[str], relay: Callable[[Line], Line], limit_s: float, run_end: float
) -> tuple[int | None, list[Line]]:
    """Run `command`, relaying every line it prints that is a JSON object with a "stage"; its exit
    code (None: it was ended, at CHILD_START_S without a start or at `limit_s` + CHILD_GRACE_S
    after it, never later than `run_end`) and the lines relayed."""

    def wait_s(cap: float) -> float:  # never past the run's end
        return max(1.0, min(cap, run_end - time.perf_counter()))

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    emitted: list[Line] = []
    started = threading.Event()  # set at CHILD_STARTED, or when the child's stdout ends
    pump = threading.Thread(
        target=_pump, args=(proc, relay, emitted, started), name="selftest-child", daemon=True
    )
    pump.start()
    code: int | None = None
    if started.wait(timeout=wait_s(CHILD_START_S)):
        try:
            code = proc.wait(timeout=wait_s(limit_s + CHILD_GRACE_S))
        except subprocess.TimeoutExpired:
            pass
    if code is None:
        _end_group(proc)
    pump.join(timeout=10.0)
    return code, emitted


def _pump(
    proc: subprocess.Popen, relay: Callable[[Line], Line], emitted: list[Line], started: threading.Event
) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        raw = raw.strip()
        if raw == CHILD_STARTED:
            started.set()
            continue
        try:
            line = json.loads(raw) if raw.startswith("{") else None
        except ValueError:
            line = None
        if isinstance(line, dict) and "stage" in line:
            emitted.append(relay(line))
        elif raw:
            log.info("child: %s", raw)
    started.set()  # it ended without starting the stage: nothing more to wait for


def _end_group(proc: subprocess.Popen) -> None:
    """End the child and its own children (Inductor's compile workers), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def child_facts(state: dict[str, Any]) -> dict[str, Any]:
    """The plain numbers of `state` (the matmul ceiling, the eager ms per size, ...) for a child:
    what its lines are compared with. Objects (models, pipelines) stay here."""

    def plain(value: Any) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, (int, str)) and plain(v) for k, v in value.items())
        return isinstance(value, (int, float, str, bool)) or value is None

    return {k: v for k, v in state.items() if plain(v)}


def load_facts(text: str) -> dict[str, Any]:
    """`child_facts` back from JSON: integer keys (sizes) are integers again."""

    def keys(value: Any) -> Any:
        if isinstance(value, dict):
            return {int(k) if k.lstrip("-").isdigit() else k: keys(v) for k, v in value.items()}
        return value

    return keys(json.loads(text)) if text else {}
