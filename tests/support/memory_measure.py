"""The CPU allocator's peak while a function runs, from torch.profiler's memory events.

With `profile_memory=True` the profiler records every allocation and free of the CPU
allocator (size and address); replaying them in time order gives the peak of bytes allocated
inside the window, intra-op workspaces included. Tensors allocated before the window (weights,
inputs made outside) are not counted.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        raise RuntimeError("the profiler recorded no allocation: cannot measure a peak")
    current = peak = 0
    for e in memory:
        current += e["args"]["Bytes"]
        peak = max(peak, current)
    return peak
