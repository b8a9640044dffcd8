"""The self-test's runner: a registry of stages, each under a deadline, one JSON line per measurement.

A stage is a function of a `Context`. Stages run in registry order (the most valuable numbers
first), each only when the run's budget still holds its estimate, and each under its own
deadline: a stage that runs out of time stops at its next `ctx.check()` with a line saying so. A
compile cannot stop at a check, so the compile-heavy stages (`isolated=True`) run in a child
process (`child_process.py`) that the runner ends at the stage's deadline with a `timeout` line;
the later stages run as usual. What such a stage leaves for later ones is taken over in this
process by its `adopt` function (lazily: compiled targets load from the Inductor cache the child
filled). A call that blocks past the whole budget in this process is reported by
a watchdog thread, which writes the summary and ends the process. No path ends the run without a
line.

Other work adds its lines by registering a stage (`stage(...)`, optionally `after=` an existing
one), as the FP8 lines (`fp8_speed.py`) and the worker's batch generator (`worker_path.py`) do.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditfleet.workers.selftest.child_process import CHILD_STARTED, child_facts, run_child_process

log = logging.getLogger("ditfleet.selftest")


class StageDeadline(Exception):
    """Raised by `Context.check` when the current stage (or the run) is out of time."""


class StageSkipped(Exception):
    """Raised by a stage that cannot run here (no CUDA, no diffusers, a missing slot function)."""


@dataclass(frozen=True)
class Stage:
    name: str
    fn: Callable[[Context], None]
    estimate_s: float  # expected seconds on one H100/H200 (what the budget check uses)
    limit_s: float  # this stage's own deadline on a GPU
    doc: str = ""
    check: bool = False  # a correctness stage: a failure makes the run fail
    isolated: bool = False  # runs in a child process, ended at its deadline (a compile inside)
    # Run in this process after the stage (isolated or not) with the lines it emitted: takes over
    # what the stage leaves for later ones.
    adopt: Callable[[Context, list[dict[str, Any]]], None] | None = None
    frees: tuple[str, ...] = ()  # ctx.state keys dropped before its child starts (device memory)
    optional: bool = False  # beyond the budget's plan: runs only when named (--extra or --only)


STAGES: list[Stage] = []


def stage(
    name: str,
    estimate_s: float,
    limit_s: float,
    *,
    check: bool = False,
    after: str | None = None,
    isolated: bool = False,
    adopt: Callable[[Context, list[dict[str, Any]]], None] | None = None,
    frees: tuple[str, ...] = (),
    optional: bool = False,
) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
    """Register a stage; `after`: insert it right after the named stage (else at the end)."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if any(s.name == name for s in STAGES):
            raise ValueError(f"self-test stage {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        entry = Stage(name, fn, estimate_s, limit_s, doc, check, isolated, adopt, tuple(frees), optional)
        index = len(STAGES)
        if after is not None:
            names = [s.name for s in STAGES]
            if after not in names:
                raise ValueError(f"self-test stage {name!r}: no stage {after!r} to follow")
            index = names.index(after) + 1
        STAGES.insert(index, entry)
        return fn

    return register


@dataclass
class Context:
    """What a stage sees: the run's options, device, output folder, shared state and `emit`."""

    args: Any
    out: Path
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    tiny: bool
    started: float
    budget_s: float
    # Weight shards, the worker's shard, the Inductor cache: never under `out`.
    scratch: Path | None = None
    keep_scratch: bool = False
    # The command that runs one isolated stage in a child (None: run every stage in this process).
    child_command: list[str] | None = None
    child: bool = False  # this process is such a child: lines go to stdout only
    state: dict[str, Any] = field(default_factory=dict)
    lines: list[dict[str, Any]] = field(default_factory=list)
    current: str = ""
    stage_deadline: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        """Seconds left to the current stage: its own deadline or the run's, whichever is first."""
        now = time.perf_counter()
        return min(self.stage_deadline, self.started + self.budget_s) - now

    def check(self, what: str = "") -> None:
        """Stop the stage here when it is out of time (raises StageDeadline)."""
        if self.left() <= 0:
            raise StageDeadline(what or "deadline")

    def emit(self, line: dict[str, Any], stage_name: str | None = None) -> dict[str, Any]:
        """Print one JSON line now (flushed) and keep it in `selftest.jsonl`."""
        full = {"stage": stage_name or self.current, **line, "t_s": round(self.elapsed(), 1)}
        return self.relay(full)

    def relay(self, full: dict[str, Any]) -> dict[str, Any]:
        """Print a complete line (a child's, or `emit`'s) and keep it; a child's own lines go to
        stdout only, and its parent keeps them."""
        text = json.dumps(full, default=str)
        with self._lock:
            self.lines.append(full)
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            if not self.child:
                with open(self.out / "selftest.jsonl", "a") as f:
                    f.write(text + "\n")
        log.info("%s", text)
        return full

    def remove_scratch(self) -> None:
        if self.scratch is not None and not self.keep_scratch and not self.child:
            shutil.rmtree(self.scratch, ignore_errors=True)


# The summary's lists of stages, each filled by the lines of these statuses.
SUMMARY_LISTS = {
    "failed": ("fail",),
    "passed": ("pass",),
    "skipped": ("skipped", "deadline"),
    "error": ("error",),
    "timeout": ("timeout",),
}


def _summary(ctx: Context, stopped: str | None = None) -> dict[str, Any]:
    by_status = {
        key: list(dict.fromkeys(line["stage"] for line in ctx.lines if line.get("status") in statuses))
        for key, statuses in SUMMARY_LISTS.items()
    }
    checks = {s.name for s in STAGES if s.check}
    # A correctness stage that never finished has not passed; a speed stage's timeout is a
    # missing number, reported.
    failed = by_status["failed"] or by_status["error"] or checks & set(by_status["timeout"])
    out: dict[str, Any] = {"status": "fail" if failed else "pass", **by_status}
    out["wall_s"] = round(ctx.elapsed(), 1)
    if stopped:
        out["stopped"] = stopped
    return out


def _end_overdue_run(ctx: Context) -> None:
    """The watchdog: ends the run, with its lines, when one call blocks past the budget."""
    ctx.emit({"status": "deadline", "reason": f"still running past the {ctx.budget_s:.0f} s budget"})
    with open(ctx.out / "selftest.log", "a") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    ctx.emit(_summary(ctx, stopped=f"watchdog in stage {ctx.current}"), stage_name="summary")
    ctx.remove_scratch()
    os._exit(3)


def run_stages(
    ctx: Context, only: set[str] | None, skip: set[str], extra: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Every registered stage in order (an optional one only when named in `only` or `extra`),
    under the budget; the summary line last."""
    watchdog = threading.Timer(max(1.0, ctx.budget_s + 30.0), _end_overdue_run, (ctx,))
    watchdog.name = "selftest-watchdog"
    watchdog.daemon = True
    watchdog.start()
    try:
        for entry in list(STAGES):
            ctx.current = entry.name
            if (only and entry.name not in only) or entry.name in skip:
                continue
            if entry.optional and entry.name not in (only or set()) | set(extra):
                continue
            estimate = 0.0 if ctx.tiny else entry.estimate_s
            left = ctx.started + ctx.budget_s - time.perf_counter()
            if left < estimate:
                ctx.emit(
                    {
                        "status": "skipped",
                        "reason": f"budget: {left:.0f} s left, needs about {estimate:.0f} s",
                    }
                )
                continue
            first = len(ctx.lines)
            if entry.isolated and ctx.child_command is not None:
                run_isolated(ctx, entry)
            else:
                run_stage(ctx, entry)
            if entry.adopt is not None:
                _adopt(ctx, entry, ctx.lines[first:])
    finally:
        watchdog.cancel()
    ctx.current = "summary"
    return ctx.emit(_summary(ctx))


def stage_limit(ctx: Context, entry: Stage) -> float:
    return entry.limit_s * (ctx.args.limit_scale if ctx.tiny else 1.0)


def run_stage(ctx: Context, entry: Stage) -> None:
    """One stage in this process under its deadline; every outcome is a line."""
    ctx.current = entry.name
    limit = stage_limit(ctx, entry)
    ctx.stage_deadline = time.perf_counter() + limit
    t0 = time.perf_counter()
    log.info("== stage %s (limit %.0f s)", entry.name, limit)
    try:
        entry.fn(ctx)
    except StageDeadline as e:
        ctx.emit(
            {
                "status": "deadline",
                "reason": f"out of time at {e} after {time.perf_counter() - t0:.0f} s",
            }
        )
    except StageSkipped as e:
        ctx.emit({"status": "skipped", "reason": str(e)})
    except Exception as e:  # noqa: BLE001 - one stage's failure must not stop the next
        log.error("stage %s failed:\n%s", entry.name, traceback.format_exc())
        ctx.emit({"status": "error", "error": _error_text(e)})
    log.info("== stage %s took %.1f s", entry.name, time.perf_counter() - t0)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_isolated(ctx: Context, entry: Stage) -> None:
    """One stage in a child process (child_process.run_child_process), its lines relayed as they
    come; a child ended at the stage's deadline leaves a `timeout` line."""
    assert ctx.child_command is not None
    for key in entry.frees:
        ctx.state.pop(key, None)
    _empty_device_cache(ctx)
    limit = stage_limit(ctx, entry)
    command = [
        *ctx.child_command,
        "--child-stage",
        entry.name,
        "--child-offset-s",
        f"{ctx.elapsed():.3f}",
        "--budget-s",
        str(ctx.budget_s),
        "--child-facts",
        json.dumps(child_facts(ctx.state)),
    ]
    log.info("== stage %s in a child process (limit %.0f s): %s", entry.name, limit, command)
    t0 = time.perf_counter()
    code, emitted = run_child_process(command, ctx.relay, limit, run_end=ctx.started + ctx.budget_s + 15.0)
    took = time.perf_counter() - t0
    ctx.current = entry.name
    if code is None:
        ctx.emit(
            {
                "status": "timeout",
                "reason": f"still running after {took:.0f} s (limit {limit:.0f} s): its process was "
                "ended; the later stages run",
            }
        )
    elif code != 0 and not any("status" in line for line in emitted):
        ctx.emit({"status": "error", "error": f"its child process exited with {code} without a line"})
    log.info("== stage %s took %.1f s (child exit %s)", entry.name, took, code)


def _empty_device_cache(ctx: Context) -> None:
    if ctx.cuda:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _adopt(ctx: Context, entry: Stage, lines: list[dict[str, Any]]) -> None:
    assert entry.adopt is not None
    ctx.current = entry.name
    try:
        entry.adopt(ctx, lines)
    except Exception as e:  # noqa: BLE001 - the later stages still run, and say what they miss
        log.error("stage %s: taking over its results failed:\n%s", entry.name, traceback.format_exc())
        ctx.emit({"status": "error", "error": f"after the stage: {_error_text(e)}"})


def run_child(ctx: Context, name: str) -> int:
    """The child side of `run_isolated`: the one stage, its lines on stdout, no summary."""
    entries = [s for s in STAGES if s.name == name]
    if not entries:
        print(f"--child-stage: no stage {name!r}", file=sys.stderr)
        return 2
    print(CHILD_STARTED, flush=True)
    run_stage(ctx, entries[0])
    return 0
