"""Count torch.compile compilations, so a worker can prove that none happen on the request path.

Dynamo calls its compile-start callbacks once for every frame it converts (a first compile or a
recompile after a guard failure), whatever the backend. One callback, registered the first time
anything here is used (never at import), keeps a process-wide, monotonic count; per-shard
numbers are differences of it (`count_compiles()`).

`torch._dynamo.utils.counters` holds similar numbers, but `torch._dynamo.reset()` and tests
clear it; this count only ever grows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_lock = threading.Lock()
_state = {"count": 0}


def _on_compile_start(args) -> None:
    from torch._dynamo.callback import CallbackTrigger

    # Only Dynamo frame conversions are compilations of ours; lazy backward and runtime
    # autotuning triggers are not new graphs.
    if getattr(args, "callback_trigger", CallbackTrigger.DYNAMO) is CallbackTrigger.DYNAMO:
        with _lock:
            _state["count"] += 1


def ensure_counting() -> None:
    """Register the compile-start callback (idempotent, thread-safe).

    `torch._dynamo.reset()` (called by torch itself and by libraries) clears every registered
    callback, so this checks that ours is still there rather than remembering that it once was;
    every count taken goes through here, so a reset between two counts is repaired at the next.
    """
    handler = torch._dynamo.callback_handler
    with _lock:
        if _on_compile_start not in handler.start_callbacks:
            handler.register_start_callback(_on_compile_start)


def compile_count() -> int:
    """Dynamo compilations (first compiles and recompiles) in this process since counting began.

    Counting begins at the first call of this, `ensure_counting` or `apply_compile`.
    """
    ensure_counting()
    with _lock:
        return int(_state["count"])


@dataclass
class CompileTally:
    """Compilations seen inside one `count_compiles()` block; `count` is final after the block."""

    start: int
    count: int = 0


@contextmanager
def count_compiles() -> Iterator[CompileTally]:
    """`with count_compiles() as c: serve_shard(); stats["compiles"] = c.count`."""
    tally = CompileTally(start=compile_count())
    try:
        yield tally
    finally:
        tally.count = compile_count() - tally.start
