"""The self-test's runner: a registry of stages, each under a deadline, one JSON line per measurement.

A stage is a function of a `Context`. Stages run in registry order (the most valuable numbers
first), each only when the run's budget still holds its estimate, and each under its own
deadline: a stage that runs out of time stops at its next `ctx.check()` with a line saying so, and
a call that blocks past the whole budget (a compile that hangs) is reported by a watchdog thread,
which writes the summary and ends the process. No path ends the run without a line.

Other work adds its lines by registering a stage (`stage(...)`, optionally `after=` an existing
one); the FP8 and step-cache lines have their slots in `speed.py`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


STAGES: list[Stage] = []


def stage(
    name: str, estimate_s: float, limit_s: float, *, check: bool = False, after: str | None = None
) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
    """Register a stage; `after`: insert it right after the named stage (else at the end)."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if any(s.name == name for s in STAGES):
            raise ValueError(f"self-test stage {name!r} is registered twice")
        doc = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        entry = Stage(name, fn, estimate_s, limit_s, doc, check)
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
        text = json.dumps(full, default=_jsonable)
        with self._lock:
            self.lines.append(full)
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            with open(self.out / "selftest.jsonl", "a") as f:
                f.write(text + "\n")
        log.info("%s", text)
        return full


def _jsonable(value: Any) -> Any:
    return str(value)


def _summary(ctx: Context, stopped: str | None = None) -> dict[str, Any]:
    by_status: dict[str, list[str]] = {"failed": [], "passed": [], "skipped": [], "error": []}
    for line in ctx.lines:
        status = line.get("status")
        name = line["stage"]
        if status == "fail":
            by_status["failed"].append(name)
        elif status == "pass":
            by_status["passed"].append(name)
        elif status in ("skipped", "deadline"):
            by_status["skipped"].append(name)
        elif status == "error":
            by_status["error"].append(name)
    by_status = {k: list(dict.fromkeys(v)) for k, v in by_status.items()}
    out = {"status": "fail" if by_status["failed"] or by_status["error"] else "pass", **by_status}
    out["wall_s"] = round(ctx.elapsed(), 1)
    if stopped:
        out["stopped"] = stopped
    return out


class Watchdog:
    """Ends the run, with its lines, when one call blocks past the budget (plus a grace)."""

    def __init__(self, ctx: Context, grace_s: float) -> None:
        self.ctx, self.grace_s = ctx, grace_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="selftest-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def _watch(self) -> None:
        ctx = self.ctx
        if self.done.wait(timeout=max(1.0, ctx.budget_s + self.grace_s)):
            return
        ctx.emit({"status": "deadline", "reason": f"still running past the {ctx.budget_s:.0f} s budget"})
        log_file = ctx.out / "selftest.log"
        with open(log_file, "a") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        ctx.emit(_summary(ctx, stopped=f"watchdog in stage {ctx.current}"), stage_name="summary")
        os._exit(3)


def run_stages(ctx: Context, only: set[str] | None, skip: set[str]) -> dict[str, Any]:
    """Every registered stage in order, under the budget; the summary line last."""
    watchdog = Watchdog(ctx, grace_s=30.0).start()
    try:
        for entry in list(STAGES):
            ctx.current = entry.name
            if (only and entry.name not in only) or entry.name in skip:
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
            limit = entry.limit_s * (ctx.args.limit_scale if ctx.tiny else 1.0)
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
                ctx.emit(
                    {
                        "status": "error",
                        "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                    }
                )
            log.info("== stage %s took %.1f s", entry.name, time.perf_counter() - t0)
    finally:
        watchdog.done.set()
    ctx.current = "summary"
    return ctx.emit(_summary(ctx))
