"""The real worker in front of a slow input store, with a log of when it reads and generates.

`SlowInputWorker` is `GenerationWorker` whose shard reads take `read_latency_s` longer (an
object store far away: a Parquet footer and its row-group ranges are a few round trips each),
and which appends one JSON line per event to `log_path`: `read_start` / `read_end` (the rows),
`generate_start` / `generate_end` (the shard's images, made and stored) and `run_end`, each with
the shard, the thread and `time.time()`. The gap between shards is then
`generate_start` of one shard minus `generate_end` of the one before on the same actor.
Used by the prefetch test (tests/integration/test_prefetch.py) and bench/shard_gap.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import ShardResult, WorkerConfig
from ditfleet.workers.rows import PromptRow, ShardSpec


class SlowInputWorker(GenerationWorker):
    def __init__(self, config: WorkerConfig, read_latency_s: float, log_path: str) -> None:
        self.read_latency_s = read_latency_s
        self.log_path = log_path
        self._log_lock = threading.Lock()
        super().__init__(config)

    def _log(self, event: str, shard: int) -> None:
        line = {"event": event, "shard": shard, "pid": os.getpid(), "t": time.time()}
        line["thread"] = threading.current_thread().name
        with self._log_lock, open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def read_rows(self, shard: ShardSpec) -> list[PromptRow]:
        self._log("read_start", shard.index)
        time.sleep(self.read_latency_s)
        rows = super().read_rows(shard)
        self._log("read_end", shard.index)
        return rows

    def _generate_and_store(self, shard: int, requests: list, extras: list, token: str) -> Any:
        self._log("generate_start", shard)
        try:
            return super()._generate_and_store(shard, requests, extras, token)
        finally:
            self._log("generate_end", shard)

    def run_shard(self, shard: ShardSpec, attempt: int = 0) -> ShardResult:
        result = super().run_shard(shard, attempt)
        self._log("run_end", shard.index)
        return result


def read_log(log_path: str | Path) -> list[dict]:
    """The events, in time order."""
    lines = Path(log_path).read_text().splitlines() if Path(log_path).exists() else []
    return sorted((json.loads(line) for line in lines if line), key=lambda e: e["t"])


def shard_gaps(events: Iterable[dict]) -> list[float]:
    """Per actor, each time from one shard's `generate_end` to the next shard's `generate_start`:
    how long the device waited between two shards."""
    gaps: list[float] = []
    last_end: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "generate_start" and e["pid"] in last_end:
            gaps.append(e["t"] - last_end.pop(e["pid"]))
        elif e["event"] == "generate_end":
            last_end[e["pid"]] = e["t"]
    return gaps
