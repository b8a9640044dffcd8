"""A stand-in worker that stores real output objects without a model: the project's own shard
writers (files, parquet, webdataset) over tiny solid-colour images, and a real manifest commit of
the shard spec's generation. For the pause and kill tests of the driver's writes, where what
matters is which objects exist and which manifest names them, not the pixels.

It does what the real worker (workers.actor) does around the commit: it skips a shard whose
manifest of this generation exists, draws its attempt token for the shard's generation, stores
every object before the commit, and deletes its own objects when its commit loses. A shard listed
in `pause_shards` stops before its commit at the test point `worker_before_commit` (the whole
process, SIGSTOP: a straggler) or waits at `worker_hold_before_commit` (this thread only, so a
driver running it in-process keeps renewing its lease).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs

from ditfleet.workers.contract import ShardResult, WorkerConfig
from ditfleet.workers.output.formats import make_shard_writer
from ditfleet.workers.output.formats.base import ImageTask
from ditfleet.workers.output.layout import manifest_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestRow, ManifestWriter
from ditfleet.workers.rows import read_shard_rows
from ditfleet.workers.storage import open_store
from tests.support.pause_seam import hold_point, stop_point

STOP_BEFORE_COMMIT = "worker_before_commit"
HOLD_BEFORE_COMMIT = "worker_hold_before_commit"


@dataclass(frozen=True)
class FormatWorkerConfig(WorkerConfig):
    pause_shards: tuple[int, ...] = ()  # shards that stop (or wait) before their commit
    # A run that checked for the shard's manifest before another run committed it (a twin that
    # started earlier): it stores its objects whatever is committed now.
    checked_before_commit: bool = False


class FormatWorker:
    def __init__(self, config: FormatWorkerConfig) -> None:
        self.config = config
        self.store = open_store(config.output_uri, config.s3)
        self.worker_id = f"format-worker-{os.getpid()}"

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

    def run_shard(self, shard, attempt: int = 0) -> ShardResult:
        generation = shard.generation
        if not self.config.checked_before_commit and self.store.exists(manifest_key(shard.index, generation)):
            return self._result(shard, attempt, "already_committed")
        token = new_attempt_token(attempt, generation)
        rows = read_shard_rows(shard, pafs.LocalFileSystem(), self.config.rows)
        writer = make_shard_writer(self.store, shard.index, self.config.writer, token)
        shade = int(hashlib.sha256(token.encode()).hexdigest()[:2], 16)  # each run its own bytes
        try:
            for r in rows:
                task = ImageTask(id=r.id, prompt=r.prompt, negative_prompt=r.negative_prompt, seed=r.seed)
                writer.add(task, np.full((r.height, r.width, 3), shade, dtype=np.uint8))
            stored = writer.finish()
        except BaseException:
            writer.abort()
            raise
        manifest = ManifestWriter(shard.index, expected_rows=len(rows), generation=generation)
        by_id = {res.id: res for res in stored.results}
        for r in rows:
            res = by_id[r.id]
            manifest.add(
                ManifestRow(
                    id=r.id,
                    k=0,
                    prompt=r.prompt,
                    seed=r.seed,
                    width=r.width,
                    height=r.height,
                    bucket=r.bucket,
                    steps=r.steps,
                    true_cfg_scale=float(r.true_cfg_scale),
                    model_id="format-worker",
                    status="ok" if res.ok else "failed",
                    error=res.error,
                    uri=res.uri,
                    sha256=res.sha256,
                    bytes=res.bytes,
                    format=self.config.writer.image_format,
                    worker=self.worker_id,
                    attempt=attempt,
                    shard=shard.index,
                )
            )
        if shard.index in self.config.pause_shards:
            hold_point(HOLD_BEFORE_COMMIT)
            stop_point(STOP_BEFORE_COMMIT)
        if not manifest.commit(self.store):
            for key in stored.keys:  # as the real worker: a losing run removes its own objects
                self.store.delete(key)
            return self._result(shard, attempt, "already_committed", token)
        return self._result(shard, attempt, "committed", token)

    def _result(self, shard, attempt: int, status: str, token: str = "") -> ShardResult:
        n = shard.num_images if status == "committed" else 0
        return ShardResult(
            shard=shard.index,
            attempt=attempt,
            status=status,
            rows=shard.num_rows if n else 0,
            images_ok=n,
            worker_id=self.worker_id,
            attempt_token=token,
        )
