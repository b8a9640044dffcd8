"""Watching one benchmark run from outside: the store, the processes, and one kill.

`RunWatch` polls a callable that counts images durably stored (what a reader of the output would
see), samples the peak RSS and CPU time of the processes of this process's local Ray, and, when
asked, SIGKILLs one busy actor once a fraction of the images is stored. `run_driver` starts a
driver process and waits for it with `os.wait4`, which gives that process's own peak RSS and CPU.

Processes are found among this process's descendants (the local Ray that this process started,
and the drivers), actors by the title Ray gives them ("ray::GenerationWorker.run_shard",
"ray::MapWorker(MapBatches(...)).submit"), so nothing outside the benchmark is looked at or
signalled. CPU time is what a shared machine's other tenants cannot inflate: on a busy machine
it is the fair measure of work. Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_TICK_S = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcSample:
    ppid: int
    cpu_s: float  # user + system time so far


def _scan() -> dict[int, ProcSample]:
    """Every process's parent and CPU time, from /proc/*/stat."""
    out: dict[int, ProcSample] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command (field 2) may hold spaces: split after its closing ')'. Then field 4 is
        # the parent pid and fields 14, 15 are user and system time in clock ticks.
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry)] = ProcSample(int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK_S)
    return out


def descendants(root: int, procs: dict[int, ProcSample]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    todo, seen = [root], []
    while todo:
        for child in children.get(todo.pop(), []):
            seen.append(child)
            todo.append(child)
    return seen


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM: the process's peak resident set size so far, in MiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class WatchResult:
    first_image_at: float | None = None  # time.time() when the first image was visible
    first_count: int = 0  # images visible at that moment (a Parquet file holds several)
    all_images_at: float | None = None  # when `total` images were visible
    actor_peak_rss_mb: dict[int, float] = field(default_factory=dict)  # pid -> VmHWM
    actor_cpu_s: dict[int, float] = field(default_factory=dict)  # pid -> CPU during the run
    actor_startup_cpu_s: dict[int, float] = field(default_factory=dict)  # pid -> CPU before its first task
    other_cpu_s: float = 0.0  # every other process of this Ray (raylet, GCS, task workers)
    titles: set[str] = field(default_factory=set)  # actor process titles seen
    killed_pid: int | None = None
    killed_at: float | None = None
    stored_at_kill: int | None = None


class RunWatch(threading.Thread):
    """Polls every `interval_s` until stopped; see the module docstring.

    work_method: the actor method that does the work ("run_shard", "submit"); an actor's CPU
    before it first runs it is its start-up (imports, model load). exclude: pids whose CPU is
    not the run's (the S3 server, this process). `driver_pid` is set once the driver started
    (its CPU comes from `run_driver`, exactly).
    """

    def __init__(
        self,
        count_stored: Callable[[], int],
        total: int,
        actor_marker: str,
        work_method: str,
        kill_at_fraction: float | None = None,
        exclude: tuple[int, ...] = (),
        interval_s: float = 0.2,
    ) -> None:
        super().__init__(daemon=True)
        self.count_stored, self.total, self.marker = count_stored, total, actor_marker
        self.work_method = work_method
        self.kill_at, self.exclude, self.interval_s = kill_at_fraction, {os.getpid(), *exclude}, interval_s
        self.driver_pid: int | None = None
        self.result = WatchResult()
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._cpu_at_start = {p: s.cpu_s for p, s in _scan().items()}  # CPU spent before the run
        self._cpu: dict[int, float] = {}  # pid -> CPU during the run, last seen
        self._titles: dict[int, str] = {}

    def stop(self) -> WatchResult:
        self._halt.set()
        self.join(timeout=30)
        r = self.result
        actor_pids = {p for p, t in self._titles.items() if t.startswith(f"ray::{self.marker}")}
        r.actor_cpu_s = {p: c for p, c in self._cpu.items() if p in actor_pids}
        r.other_cpu_s = sum(c for p, c in self._cpu.items() if p not in actor_pids and p != self.driver_pid)
        return r

    def run(self) -> None:
        r = self.result
        while not self._halt.is_set():
            try:
                n = self.count_stored()
            except Exception as e:  # noqa: BLE001 - a listing during a write may fail; try again
                self.errors.append(f"{type(e).__name__}: {e}")
                n = 0
            now = time.time()
            if n and r.first_image_at is None:
                r.first_image_at, r.first_count = now, n
            if n >= self.total and r.all_images_at is None:
                r.all_images_at = now
            busy = self._sample()
            if self.kill_at is not None and r.killed_pid is None and n >= self.kill_at * self.total and busy:
                os.kill(busy[0], signal.SIGKILL)
                r.killed_pid, r.killed_at, r.stored_at_kill = busy[0], now, n
            self._halt.wait(self.interval_s)

    def _sample(self) -> list[int]:
        """Record CPU and peak RSS; return the actors running their work method (the title
        names it, e.g. "ray::GenerationWorker.run_shard"), the ones worth killing."""
        procs = _scan()
        busy = []
        for pid in descendants(os.getpid(), procs):
            if pid in self.exclude:
                continue
            self._cpu[pid] = procs[pid].cpu_s - self._cpu_at_start.get(pid, 0.0)
            # Read every time: a pooled "ray::IDLE" worker becomes an actor, and an actor's
            # title names the method it is running.
            title = cmdline(pid) or self._titles.get(pid, "")
            if title.startswith(f"ray::{self.marker}"):
                self.result.titles.add(title)
                rss = peak_rss_mb(pid)
                if rss is not None:
                    self.result.actor_peak_rss_mb[pid] = max(rss, self.result.actor_peak_rss_mb.get(pid, 0.0))
                method = title.split()[0].removeprefix(f"ray::{self.marker}")
                if method.endswith(f".{self.work_method}"):
                    busy.append(pid)
                    self.result.actor_startup_cpu_s.setdefault(pid, self._cpu[pid])
            self._titles[pid] = title
        return sorted(busy)


@dataclass
class DriverRun:
    returncode: int
    started_at: float  # time.time() at launch
    ended_at: float
    peak_rss_mb: float  # the driver process's own peak (ru_maxrss)
    cpu_s: float  # the driver process's own user + system time
    log: Path

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.started_at


def run_driver(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    log: Path,
    timeout_s: float,
    on_start: Callable[[int], None] = lambda pid: None,
) -> DriverRun:
    """Run a driver to its end, output to `log`. On timeout its process group is killed (the
    driver's actors die with it: Ray ends a job's actors when its driver exits)."""
    with log.open("wb") as out:
        started = time.time()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        on_start(proc.pid)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    cpu = usage.ru_utime + usage.ru_stime
    return DriverRun(proc.returncode, started, time.time(), usage.ru_maxrss / 1024, cpu, log)
