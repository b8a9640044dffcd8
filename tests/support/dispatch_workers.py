"""A stand-in for the generation worker, for testing dispatch: same methods, no model.

`SleepingWorker` is run by Ray as a real actor. Its `run_shard` sleeps a fixed time, writes one
small object per requested image and commits a real manifest through the storage layer
(create-only, first writer wins), so resume and first-commit-wins work exactly as with the real
worker. What it does per shard and attempt (fail, hang, get slow) is set in its config.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from ditfleet.workers.contract import ShardAbandoned, ShardResult, WorkerConfig
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestRow, ManifestWriter
from ditfleet.workers.rows import read_shard_rows
from ditfleet.workers.storage import open_store


@dataclass(frozen=True)
class SleepingWorkerConfig(WorkerConfig):
    """A WorkerConfig (what the driver hands every actor) with what the sleeper does per shard."""

    shard_s: float = 0.05  # sleep per shard
    fail: dict[int, int] = field(default_factory=dict)  # shard -> attempts that raise (-1: all)
    hang: dict[int, float] = field(default_factory=dict)  # shard -> sleep on attempt 0 instead
    # shard -> attempts that give the shard up as a worker asked to stop does (ShardAbandoned)
    abandon: dict[int, int] = field(default_factory=dict)
    pid_dir: str | None = None  # attempt 0 of a `hang` shard writes "{pid_dir}/{shard}.pid"
    slow_first_actor_s: float | None = None  # the first actor to start sleeps this per shard
    marker_dir: str | None = None  # where actors claim "first" and log their runs
    startup_s: float = 0.0
    # Read and resolve the shard's real rows (workers.rows.read_shard_rows, with `rows`) for their
    # ids, instead of using positions: for tests of jobs whose ids come from the input.
    read_rows: bool = False


class SleepingWorker:
    def __init__(self, config: SleepingWorkerConfig) -> None:
        self.config = config
        self.store = open_store(config.output_uri)
        self.worker_id = f"sleeper-{os.getpid()}"
        self.shard_s = config.shard_s
        if config.slow_first_actor_s is not None and config.marker_dir:
            try:
                os.close(os.open(os.path.join(config.marker_dir, "first"), os.O_CREAT | os.O_EXCL))
                self.shard_s = config.slow_first_actor_s
                self.worker_id += "-slow"
            except FileExistsError:
                pass
        time.sleep(config.startup_s)

    def startup_report(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "load_s": 0.0,
            "warmup_s": {},
            "device": "cpu",
            "pid": os.getpid(),
        }

    def ping(self) -> str:
        return self.worker_id

    def _log_run(self, shard: int, attempt: int) -> None:
        if self.config.marker_dir:
            with open(os.path.join(self.config.marker_dir, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"shard": shard, "attempt": attempt, "worker": self.worker_id}) + "\n")

    def run_shard(self, shard, attempt: int) -> ShardResult:
        t0 = time.monotonic()
        self._log_run(shard.index, attempt)
        if self.store.exists(manifest_key(shard.index)):
            return self._result(shard, attempt, "already_committed", t0)
        fails = self.config.fail.get(shard.index, 0)
        if fails == -1 or attempt < fails:
            time.sleep(self.shard_s / 2)
            raise RuntimeError(f"injected failure of shard {shard.index} attempt {attempt}")
        if attempt < self.config.abandon.get(shard.index, 0):
            raise ShardAbandoned(f"shard {shard.index}: worker asked to stop; nothing committed")
        if attempt == 0 and shard.index in self.config.hang:
            if self.config.pid_dir:
                path = os.path.join(self.config.pid_dir, f"{shard.index}.pid")
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(path + ".tmp", path)
            time.sleep(self.config.hang[shard.index])
        else:
            time.sleep(self.shard_s)
        writer = ManifestWriter(shard.index, expected_rows=shard.num_images, generation=shard.generation)
        token = new_attempt_token(attempt, shard.generation)
        for row_id, k, seed, prompt in self._images(shard):
            data = f"image {row_id} {k}".encode() if k is not None else f"image {row_id}".encode()
            key = image_key(shard.index, token, row_id, k, "png")
            self.store.put(key, data)
            writer.add(
                ManifestRow(
                    id=row_id,
                    k=k or 0,
                    prompt=prompt,
                    seed=seed,
                    width=64,
                    height=64,
                    bucket="64x64",
                    steps=2,
                    true_cfg_scale=1.0,
                    model_id="sleeper",
                    status="ok",
                    uri=self.store.uri(key),
                    sha256=hashlib.sha256(data).hexdigest(),
                    bytes=len(data),
                    format="png",
                    worker=self.worker_id,
                    attempt=attempt,
                    shard=shard.index,
                )  # fmt: skip
            )
        won = writer.commit(self.store)
        return self._result(shard, attempt, "committed" if won else "already_committed", t0, token)

    def _images(self, shard) -> list[tuple[str, int | None, int, str]]:
        """(row id, k or None for a row of one image, seed, prompt) of each image of the shard."""
        if not self.config.read_rows:
            return [
                (str(p), None, p, f"prompt {p}")
                for p in range(shard.position_start, shard.position_start + shard.num_rows)
            ]
        rows = read_shard_rows(shard, pafs.LocalFileSystem(), self.config.rows)
        return [
            (r.id, k if r.num_images > 1 else None, i, r.prompt)
            for i, r in enumerate(rows)
            for k in range(r.num_images)
        ]

    def _result(self, shard, attempt: int, status: str, t0: float, token: str = "") -> ShardResult:
        n = shard.num_images if status == "committed" else 0
        return ShardResult(
            shard=shard.index, attempt=attempt, status=status, rows=shard.num_rows if n else 0,
            images_ok=n, generate_s=self.shard_s, wall_s=time.monotonic() - t0,
            worker_id=self.worker_id, attempt_token=token,
        )  # fmt: skip
