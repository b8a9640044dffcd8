"""Start a test process (tests/support/fence_entry.py), wait until it stops at a pause point,
continue or kill it.

    procs = Processes(tmp_path / "procs", base_spec)
    a = procs.start("A", mode="run", pause_at=["in_cleanup"])
    a.wait_paused("in_cleanup")      # the process wrote <dir>/in_cleanup.<pid> and is stopped
    ... act ...
    a.cont()                         # SIGCONT (or a.kill(): SIGKILL)
    assert a.finish().rc == 0

`Processes.close()` SIGKILLs what is still running (the `fence_procs` fixture calls it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.paths import REPO

WAIT_S = 90.0


@dataclass
class Finished:
    rc: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-6000:]}"


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (T: stopped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


class Process:
    def __init__(self, name: str, popen: subprocess.Popen, pause_dir: Path, logs: tuple[Path, Path]) -> None:
        self.name, self.popen, self.pause_dir, self.logs = name, popen, pause_dir, logs

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> Finished:
        out, err = (p.read_text(errors="replace") if p.exists() else "" for p in self.logs)
        return Finished(self.popen.returncode if self.popen.returncode is not None else -1, out, err)

    def pause_file(self, point: str) -> Path:
        return self.pause_dir / f"{point}.{self.pid}"

    def wait_paused(self, point: str, timeout: float = WAIT_S) -> None:
        """Until the process wrote its pause file for `point` and is stopped; fails (with its
        output) when it exits first or takes longer than `timeout`."""
        deadline = time.monotonic() + timeout
        path = self.pause_file(point)
        while not (path.exists() and _state(self.pid) == "T"):
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited before pausing at {point}: {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not pause at {point} within {timeout:.0f} s")
            time.sleep(0.02)

    def wait_held(self, point: str, timeout: float = WAIT_S) -> None:
        """Until a thread of the process waits at the hold point `point` (pause_seam.hold_point)."""
        deadline = time.monotonic() + timeout
        while not self.pause_file(point).exists():
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited before holding at {point}: {self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not hold at {point} within {timeout:.0f} s")
            time.sleep(0.02)

    def release(self, point: str) -> None:
        """Let the thread waiting at the hold point `point` go on."""
        Path(str(self.pause_file(point)) + ".go").touch()

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> Finished:
        os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(WAIT_S)
        return self.output()

    def finish(self, timeout: float = WAIT_S) -> Finished:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(WAIT_S)
            raise AssertionError(
                f"{self.name} did not exit within {timeout:.0f} s: {self.output()}"
            ) from None
        return self.output()


class Processes:
    """The processes of one test, all from one base spec (input, output, endpoint, format)."""

    def __init__(self, folder: Path, base: dict[str, Any]) -> None:
        self.folder, self.base = folder, base
        self.pause_dir = folder / "pauses"
        self.pause_dir.mkdir(parents=True, exist_ok=True)
        self.started: list[Process] = []

    def start(
        self,
        name: str,
        *,
        pause_at: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
        **spec: Any,
    ) -> Process:
        spec = {**self.base, **spec}
        n = len(self.started)
        spec_path = self.folder / f"{n:02d}-{name}.json"
        spec_path.write_text(json.dumps(spec))
        environ = {
            **os.environ,
            "DITFLEET_PAUSE_AT": ",".join(pause_at),
            "DITFLEET_PAUSE_DIR": str(self.pause_dir),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            **(env or {}),
        }
        logs = (self.folder / f"{n:02d}-{name}.out", self.folder / f"{n:02d}-{name}.err")
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            popen = subprocess.Popen(
                [sys.executable, "-m", "tests.support.fence_entry", str(spec_path)],
                cwd=REPO,
                env=environ,
                stdout=out,
                stderr=err,
            )
        proc = Process(name, popen, self.pause_dir, logs)
        self.started.append(proc)
        return proc

    def run(self, name: str, timeout: float = WAIT_S, **spec: Any) -> Finished:
        """Start a process and wait for it to exit."""
        return self.start(name, **spec).finish(timeout)

    def close(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.popen.wait(WAIT_S)
