"""Progress of a running job: a live bar, a log line per shard, and the counters the summary uses.

On a terminal the bar is redrawn in place on stderr, and log lines are printed above it. Without
one (`ray job submit` logs, cron, CI) a status line is printed every `status_every_s` instead of
the bar, so logs stay readable and grep-able.

Counts here come from the workers' shard results, for display; the final counts of the summary
come from the manifests (see driver.output.status).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from ditfleet.driver.actor_phases import UNPLACEABLE, WAITING, ActorPhase
from ditfleet.driver.dispatch.types import DispatchEvents, DispatchSnapshot, ShardFailure
from ditfleet.workers.contract import ShardResult
from ditfleet.workers.rows import ShardSpec

_BAR_WIDTH = 24
_REDRAW_S = 0.25  # bar redraws at most this often
_STARTUP_NOTICE_S = 30.0  # say where the actors are when shards have waited this long for any


def format_duration(seconds: float | None) -> str:
    """12 -> '12s', 754 -> '12m34s', 7384 -> '2h03m'; None -> '?'."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class WorkerStats:
    """One worker's share of the job (this run). Times in seconds, summed over its shards."""

    shards: int = 0
    images_ok: int = 0
    images_failed: int = 0
    busy_s: float = 0.0  # sum of shard wall times
    generate_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    recompiles: int = 0
    oom_splits: int = 0  # batches halved after a CUDA out-of-memory error
    # Images per batch it ran with (its GPU's fit, at most workers.batch_size; 0: an older actor).
    batch_size: int = 0
    attention: dict[str, int] = field(default_factory=dict)  # DiT attention counts, summed

    @property
    def images_per_s(self) -> float:
        return (self.images_ok + self.images_failed) / self.busy_s if self.busy_s > 0 else 0.0

    def add(self, result: ShardResult) -> None:
        """Count one committed shard of this worker."""
        self.shards += 1
        self.images_ok += result.images_ok
        self.images_failed += result.images_failed
        self.busy_s += result.wall_s
        self.generate_s += result.generate_s
        self.encode_s += result.encode_s
        self.upload_s += result.upload_s
        self.recompiles += result.recompiles
        self.oom_splits += result.oom_splits
        self.batch_size = max(self.batch_size, result.batch_size)
        for name, value in result.attention.items():
            self.attention[name] = self.attention.get(name, 0) + value

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "images_ok": self.images_ok,
            "images_failed": self.images_failed,
            "busy_s": round(self.busy_s, 3),
            "images_per_s": round(self.images_per_s, 3),
            "generate_s": round(self.generate_s, 3),
            "encode_s": round(self.encode_s, 3),
            "upload_s": round(self.upload_s, 3),
            "recompiles": self.recompiles,
            "oom_splits": self.oom_splits,
            "batch_size": self.batch_size,
            "attention": dict(self.attention),
        }


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def warmup_seconds(report: dict) -> float | None:
    """Total warm-up time of a start-up report: `warmup_s` as a number or as {bucket: s}."""
    value = report.get("warmup_s")
    if isinstance(value, dict):
        value = sum(v for v in value.values() if isinstance(v, (int, float)))
    return float(value) if isinstance(value, (int, float)) else None


def compile_fallbacks(report: dict) -> dict[str, str]:
    """Compile targets that fell back to eager, with why (from the report's `compile` part)."""
    compile_part = report.get("compile")
    fallbacks = compile_part.get("fallbacks") if isinstance(compile_part, dict) else None
    return dict(fallbacks) if isinstance(fallbacks, dict) else {}


def starting_summary(phases: tuple[ActorPhase, ...]) -> str:
    """'1 compiling bucket 2/3 (512x512) 12s, 1 waiting for resources 40s': actors by phase, with
    the longest time one of them has spent in it."""
    counts: Counter = Counter()
    longest: dict[tuple[str, str], float] = {}
    for p in phases:
        key = (p.describe(), p.note)
        counts[key] += 1
        longest[key] = max(longest.get(key, 0.0), p.in_phase_s)

    def one(key: tuple[str, str]) -> str:
        label, note = key
        text = f"{counts[key]} {label} {format_duration(longest[key])}"
        # "12s of about 50 s (first run only)"; "2s (from this machine's compile cache)"
        return text + (f" of {note}" if note.startswith("about") else f" ({note})" if note else "")

    return ", ".join(one(k) for k in longest)


def startup_notice(waited_s: float, phases: tuple[ActorPhase, ...], starting: int) -> str:
    """The line printed while no actor is ready: where each one is, and why, if Ray says why."""
    where = starting_summary(phases) or f"{starting} starting"
    line = f"no worker actor ready after {format_duration(waited_s)}: {where}"
    unplaceable = [p for p in phases if p.phase == UNPLACEABLE]
    waiting = [p for p in phases if p.phase == WAITING]
    if unplaceable:
        line += (
            f". {plural(len(unplaceable), 'actor')} cannot be placed: each {unplaceable[0].detail} "
            "(an autoscaler adds such a node; without one, lower workers.gpus/cpus)"
        )
    if waiting:
        line += (
            f". {plural(len(waiting), 'actor')} pending placement: the cluster has no free resources "
            "for one now (an autoscaler adds nodes for them; without one, lower workers.gpus/cpus "
            "or workers.max)"
        )
    return line


class JobProgress(DispatchEvents):
    """Receives dispatch events; shows progress; keeps this run's counters.

    total_*: the whole job; done_*: what earlier runs committed (resume), shown as done.
    """

    def __init__(
        self,
        total_shards: int,
        total_images: int,
        done_shards: int = 0,
        done_images: int = 0,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        status_every_s: float = 30.0,
        startup_notice_s: float = _STARTUP_NOTICE_S,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.status_every_s = status_every_s
        self.startup_notice_s = startup_notice_s
        self.total_shards, self.total_images = total_shards, total_images
        self.done_shards_before, self.done_images_before = done_shards, done_images
        self.shards_committed = 0
        self.images_ok = self.images_failed = 0
        self.workers: dict[str, WorkerStats] = {}
        self.startup: dict[str, dict] = {}
        self._said: set[str] = set()  # facts the actors report alike, said once per job
        self.t0 = time.monotonic()
        self._bar_shown = False
        self._last_draw = self._last_status = 0.0
        self._last_placement_notice = 0.0
        self._snapshot: DispatchSnapshot | None = None

    # -- output ----------------------------------------------------------------------------------

    def log(self, line: str) -> None:
        """Print one line (above the bar on a terminal)."""
        if self._bar_shown:
            self.stream.write("\r\x1b[K")
        self.stream.write(line + "\n")
        if self._bar_shown:
            self.stream.write(self.bar_line())
        self.stream.flush()

    def bar_line(self) -> str:
        done = self.done_images_before + self.images_ok + self.images_failed
        frac = done / self.total_images if self.total_images else 1.0
        filled = int(_BAR_WIDTH * min(frac, 1.0))
        rate = self.images_per_s()
        eta = (self.total_images - done) / rate if rate > 0 else None
        snap = self._snapshot
        actors = ""
        if snap:
            starting = starting_summary(snap.starting_phases) or f"{snap.actors_starting} starting"
            actors = f" | actors {snap.actors_ready} ready" + (
                f", {starting}" if snap.actors_starting else ""
            )
        failed = f" ({self.images_failed} failed)" if self.images_failed else ""
        return (
            f"[{'#' * filled}{'-' * (_BAR_WIDTH - filled)}] {frac:4.0%} {done}/{self.total_images} images"
            f"{failed} | {rate:.2f} img/s | ETA {format_duration(eta)}"
            f" | shards {self.done_shards_before + self.shards_committed}/{self.total_shards}{actors}"
        )

    def images_per_s(self) -> float:
        """This run's images (ok and failed) per second since the first actor took work."""
        n = self.images_ok + self.images_failed
        if not n:
            return 0.0
        start = min((s.get("_ready_at", self.t0) for s in self.startup.values()), default=self.t0)
        elapsed = time.monotonic() - start
        return n / elapsed if elapsed > 0 else 0.0

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.interactive:
            if force or now - self._last_draw >= _REDRAW_S:
                self.stream.write("\r\x1b[K" + self.bar_line())
                self.stream.flush()
                self._bar_shown = True
                self._last_draw = now
        elif force or now - self._last_status >= self.status_every_s:
            self._last_status = now
            self.log("progress: " + self.bar_line())

    def close(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self._bar_shown:
            self.stream.write("\r\x1b[K" + self.bar_line() + "\n")
            self.stream.flush()
            self._bar_shown = False

    # -- dispatch events -------------------------------------------------------------------------

    def actor_starting(self, count: int) -> None:
        self.log(f"starting {plural(count, 'worker actor')}")

    def actor_ready(self, worker_id: str, report: dict, startup_s: float) -> None:
        self.startup[worker_id] = {**report, "_ready_at": time.monotonic()}
        parts = [f"worker {worker_id} ready in {startup_s:.1f} s"]
        if isinstance(report.get("load_s"), (int, float)):
            parts.append(f"model load {report['load_s']:.1f} s")
        warmup = warmup_seconds(report)
        if warmup is not None:
            parts.append(f"warm-up {warmup:.1f} s")
        if report.get("device"):
            parts.append(f"{report['device']} {report.get('dtype', '')}".strip())
        fallbacks = compile_fallbacks(report)
        if fallbacks:
            parts.append(f"COMPILE FELL BACK TO EAGER: {fallbacks}")
        self.log(", ".join(parts))
        shared = str(report.get("shared_compile_cache", ""))
        if shared.startswith("off: ") and shared not in self._said:
            self._said.add(shared)
            self.log(f"compile cache: {shared.removeprefix('off: ')}")

    def actor_lost(self, worker_id: str, kind: str, error: str, starting: bool) -> None:
        what = "failed to start" if starting else f"lost ({kind})"
        self.log(f"worker {worker_id} {what}: {error}")

    def actor_retired(self, worker_id: str) -> None:
        self.log(f"worker {worker_id} retired (idle, nothing queued)")

    def shard_committed(self, shard: ShardSpec, result: ShardResult) -> None:
        self.shards_committed += 1
        if result.status != "committed":
            self.log(
                f"shard {shard.index:05d}: already committed (by an earlier or twin run), "
                f"attempt {result.attempt}"
            )
            self._draw()
            return
        self.images_ok += result.images_ok
        self.images_failed += result.images_failed
        worker = result.worker_id or "?"
        self.workers.setdefault(worker, WorkerStats()).add(result)
        done, wall = result.images_ok + result.images_failed, result.wall_s
        rate = done / wall if wall > 0 else 0.0
        failed_text = f", {result.images_failed} FAILED" if result.images_failed else ""
        if result.oom_splits:
            failed_text += f", {plural(result.oom_splits, 'OOM split')}"
        self.log(
            f"shard {shard.index:05d}: {result.images_ok} images ok{failed_text} in {wall:.1f} s "
            f"({rate:.2f} img/s) on {worker}, attempt {result.attempt}"
        )
        self._draw()

    def shard_retry(self, shard: ShardSpec, attempt: int, error: str) -> None:
        self.log(f"shard {shard.index:05d}: will retry (attempt {attempt}) after: {error}")

    def shard_failed(self, shard: ShardSpec, failure: ShardFailure) -> None:
        self.log(
            f"shard {shard.index:05d}: FAILED after {plural(failure.attempts, 'attempt')}: {failure.error}"
        )

    def tick(self, snapshot: DispatchSnapshot) -> None:
        self._snapshot = snapshot
        now = time.monotonic()
        if (
            snapshot.waiting_for_placement_s >= self.startup_notice_s
            and now - self._last_placement_notice >= self.startup_notice_s
        ):
            self._last_placement_notice = now
            self.log(
                startup_notice(
                    snapshot.waiting_for_placement_s, snapshot.starting_phases, snapshot.actors_starting
                )
            )
        self._draw()

    def startup_costs(self) -> dict[str, dict]:
        """Start-up reports by worker, without the private fields."""
        return {w: {k: v for k, v in r.items() if not k.startswith("_")} for w, r in self.startup.items()}
