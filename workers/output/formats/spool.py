"""What the "parquet" and "webdataset" writers share: one object per run of a shard, built in a
spooled temp file and stored whole at `finish`.

Images are encoded on the pool's threads and handed back in the order of `add`, so the format
appends them to its one file on the caller's thread, in order. The file lives in memory up to
`spool_max_bytes`, then on disk (`tmp_dir`), so a shard never sits in memory whole; it goes to
the store in one whole-object write (a multipart upload for big ones, which the store aborts on
error), so a reader never sees part of it and `abort` leaves nothing behind.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

from ditfleet.workers.output.codec import extension, sha256_hex
from ditfleet.workers.output.formats.base import ImageTask, StoredShard, WriterSettings, encode_task_image
from ditfleet.workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from ditfleet.workers.storage.base import ObjectStore


class SpooledShardWriter:
    """Base of a format that stores a shard run as one object at `key`. A format says how an
    image is named in it (`_entry`), how it is appended (`_append`) and how the file is closed
    (`_close`)."""

    content_type = "application/octet-stream"

    def __init__(self, store: ObjectStore, shard: int, config: WriterSettings, key: str) -> None:
        self.store, self.shard, self.config, self.key = store, shard, config, key
        self._ext = extension(config.image_format)
        self._spool = tempfile.SpooledTemporaryFile(max_size=config.spool_max_bytes, dir=config.tmp_dir)
        self._pool = UploadPool(config.max_in_flight, config.threads, on_result=self._appended, ordered=True)

    # -- what a format defines ---------------------------------------------------------------

    def _entry(self, task: ImageTask) -> tuple[str, str]:
        """(name of the image inside the object, how an error names it)."""
        raise NotImplementedError

    def _append(self, task: ImageTask, name: str, data: bytes, digest: str, width: int, height: int) -> None:
        """Append one encoded image (called in the order of `add`, on the caller's thread)."""
        raise NotImplementedError

    def _close(self) -> bool:
        """Finish the file in the spool; False when it holds no image (every row failed)."""
        raise NotImplementedError

    # -- the ShardWriter protocol ------------------------------------------------------------

    def add(self, task: ImageTask, image: Any, host_work: Callable[[], None] | None = None) -> None:
        name, label = self._entry(task)

        def encode() -> tuple[ImageTask, str, bytes | None, float, str | None, int, int]:
            if host_work is not None:
                host_work()
            return (task, name, *encode_task_image(self.config, task, image))

        self._pool.submit(f"{self.store.uri(self.key)} {label}", encode)

    def _appended(
        self, value: tuple[ImageTask, str, bytes | None, float, str | None, int, int]
    ) -> ImageResult:
        task, name, data, encode_s, error, width, height = value
        if data is None:
            return ImageResult(id=task.id, k=task.k, encode_s=encode_s, error=error)
        digest = sha256_hex(data)
        self._append(task, name, data, digest, width, height)
        return ImageResult(
            id=task.id,
            k=task.k,
            uri=self.store.uri(self.key),
            sha256=digest,
            bytes=len(data),
            encode_s=encode_s,
        )

    def finish(self) -> StoredShard:
        try:
            results = self._pool.drain()
            if not self._close():  # every row failed: no object
                return StoredShard(results)
            size = self._spool.tell()
            self._spool.seek(0)
            start = time.perf_counter()
            try:
                self.store.put_file(self.key, self._spool, self.content_type)
            except Exception as e:
                raise ShardStoreError(
                    f"{self.store.uri(self.key)} could not be stored: {type(e).__name__}: {e}. "
                    "The shard is not committed; it can be retried."
                ) from e
            return StoredShard(
                results, self.store.uri(self.key), size, time.perf_counter() - start, (self.key,)
            )
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the file being built. Nothing was stored yet (it goes up whole in `finish`)."""
        self._pool.close()
        self._spool.close()
