"""Output format "files": one object per image at images/{shard:05d}/{attempt}/{id}[_{k}].{ext}
(`image_key`); its writer, its reader and its registry row (FORMAT)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ditfleet.workers.output.codec import content_type, extension, sha256_hex
from ditfleet.workers.output.formats.base import (
    ImageTask,
    ManifestImage,
    OutputFormat,
    StoredImageError,
    StoredImages,
    StoredShard,
    WriterSettings,
    encode_task_image,
)
from ditfleet.workers.output.layout import ShardObjects, image_file_name, image_index_in_key
from ditfleet.workers.output.upload_pool import ImageResult, UploadPool
from ditfleet.workers.storage.base import ObjectStore

# A folder per run of a shard, one object per image in it.
OBJECTS = ShardObjects("images/")


def image_key(shard: int, attempt: str, id_: str | int, k: int | None, ext: str) -> str:
    """Key of one image: images/{shard:05d}/{attempt}/{id}[_{k}].{ext}. attempt: the run's token
    (layout.new_attempt_token); k: None for a row's only image (layout.image_index_in_key)."""
    return OBJECTS.key(shard, attempt, image_file_name(id_, k, ext))


class FilesShardWriter:
    def __init__(self, store: ObjectStore, shard: int, config: WriterSettings, attempt: str) -> None:
        self.store, self.shard, self.config, self.attempt = store, shard, config, attempt
        self._ext = extension(config.image_format)
        self._mime = content_type(config.image_format)
        self._pool = UploadPool(config.max_in_flight, config.threads)
        self._keys: list[str] = []  # appended by the pool's threads (list.append is atomic)

    def add(self, task: ImageTask, image: Any, host_work: Callable[[], None] | None = None) -> None:
        key = image_key(
            self.shard, self.attempt, task.id, image_index_in_key(task.k, task.num_images), self._ext
        )
        self._pool.submit(self.store.uri(key), lambda: self._store_one(key, task, image, host_work))

    def _store_one(
        self, key: str, task: ImageTask, image: Any, host_work: Callable[[], None] | None
    ) -> ImageResult:
        if host_work is not None:
            host_work()
        data, encode_s, error, _, _ = encode_task_image(self.config, task, image)
        if data is None:
            return ImageResult(id=task.id, k=task.k, encode_s=encode_s, error=error)
        start = time.perf_counter()
        self.store.put(key, data, self._mime)  # raises after the store's retries: shard fails
        self._keys.append(key)
        upload_s = time.perf_counter() - start
        return ImageResult(
            id=task.id,
            k=task.k,
            uri=self.store.uri(key),
            sha256=sha256_hex(data),
            bytes=len(data),
            encode_s=encode_s,
            upload_s=upload_s,
        )

    def finish(self) -> StoredShard:
        try:
            results = self._pool.drain()
            return StoredShard(results, keys=tuple(self._keys))
        finally:
            self._pool.close()

    def abort(self) -> None:
        # Images already stored stay: they are under this run's attempt token, which no manifest
        # names unless this run commits, so they are orphans that the driver deletes once another
        # run commits the shard (or `ditfleet verify --clean` does).
        self._pool.close()


class FilesShardReader:
    """Reads an image object: the object is the image of the one row that names it."""

    def read(self, store: ObjectStore, key: str, rows: Sequence[ManifestImage]) -> StoredImages:
        data = store.get(key)  # ObjectNotFound when absent
        if len(rows) != 1:
            raise StoredImageError(
                f"{store.uri(key)}: named by {len(rows)} manifest rows; an image object belongs to one"
            )
        return StoredImages(store.uri(key), {(rows[0].id, rows[0].k): data}, whole_object=True)


FORMAT = OutputFormat(
    "files",
    "one image object per image",
    OBJECTS,
    FilesShardWriter,
    FilesShardReader(),
)
