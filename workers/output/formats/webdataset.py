"""Output format "webdataset": one tar per shard, two members per image.

```
{out}/webdataset/shard-{shard:05d}-{attempt}.tar
    {key}.{png|webp|jpg}    the encoded image (the bytes the manifest's sha256 is of)
    {key}.json              {"id", "k", "prompt", "negative_prompt", "seed", "width", "height", "extra"}
```

`key` is `layout.webdataset_sample_key(id, k)`: unique within the shard and free of dots, since
WebDataset readers take everything before the first dot of a member's base name as the sample
key. The two members of a sample are adjacent, as those readers require.

Given the same images, the tar is the same bytes on every run of the shard: members are appended
in the order of `add` (encoding runs on the pool's threads, appending on the caller's), and every
header field that could vary (mtime, uid, gid, owner names, mode) is fixed. Each run still writes
its own key (the attempt token in it), since two runs need not make the same pixels. The tar is built in a spooled temp
file (memory up to `spool_max_bytes`, then disk) and stored with one whole-object write at
`finish` (a multipart upload for big ones, which the store aborts on error), so a reader never
sees part of a tar and `abort` leaves nothing behind. Failed rows have no members (the manifest
has them). The manifest rows' `uri` is the tar's URI, as the "parquet" format's is its data file.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import time
from typing import Any

from workers.output.codec import extension, sha256_hex
from workers.output.formats.base import ImageTask, ShardWriterConfig, StoredShard, encode_task_image
from workers.output.layout import image_index_in_key, webdataset_key, webdataset_sample_key
from workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from workers.storage.base import ObjectStore

TAR_CONTENT_TYPE = "application/x-tar"
# Fixed header fields: the tar's bytes depend on the images and their metadata only.
_MTIME = 0
_MODE = 0o644


def sample_metadata(task: ImageTask, width: int, height: int) -> bytes:
    """The `{key}.json` member: compact UTF-8 JSON, keys in a fixed order.

    `seed` is the seed this image was generated from (the task's: the row's seed for k = 0,
    generate.image_seed(row seed, k) for the others), so one sample alone says how to remake it;
    `width`/`height` are the stored image's pixels; `extra` is the row's pass-through columns as
    a JSON object (null when there are none)."""
    doc = {
        "id": task.id,
        "k": task.k,
        "prompt": task.prompt,
        "negative_prompt": task.negative_prompt,
        "seed": task.seed,
        "width": width,
        "height": height,
        "extra": None if task.extra is None else json.loads(task.extra),
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = _MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class WebDatasetShardWriter:
    """One tar per run of a shard at layout.webdataset_key(shard, attempt), samples in the
    order added."""

    def __init__(self, store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> None:
        self.store, self.shard, self.config = store, shard, config
        self.key = webdataset_key(shard, attempt)
        self._ext = extension(config.image_format)
        self._spool = tempfile.SpooledTemporaryFile(max_size=config.spool_max_bytes, dir=config.tmp_dir)
        # PAX: member names longer than ustar's 100 bytes (long ids) are stored whole.
        self._tar = tarfile.open(fileobj=self._spool, mode="w", format=tarfile.PAX_FORMAT)
        self._members = 0
        # Encoding runs on the pool; appending to the one tar happens in order on this thread.
        self._pool = UploadPool(config.max_in_flight, config.threads, on_result=self._append, ordered=True)

    def add(self, task: ImageTask, image: Any) -> None:
        """Queue one image ((3, H, W) float in [0, 1] or (H, W, 3) uint8); blocks while the
        pool holds `max_in_flight` images."""
        key = webdataset_sample_key(task.id, image_index_in_key(task.k, task.num_images))
        self._pool.submit(
            f"{self.store.uri(self.key)} member {key}.{self._ext}",
            lambda: (task, key, *encode_task_image(self.config, image)),
        )

    def _append(self, value: tuple[ImageTask, str, bytes | None, float, str | None, int, int]) -> ImageResult:
        task, key, data, encode_s, error, width, height = value
        if data is None:
            return ImageResult(task.id, task.k, encode_s=encode_s, error=error)
        meta = sample_metadata(task, width, height)
        # Image first, then its metadata: a sample's members must be adjacent in the tar.
        self._tar.addfile(_member(f"{key}.{self._ext}", len(data)), io.BytesIO(data))
        self._tar.addfile(_member(f"{key}.json", len(meta)), io.BytesIO(meta))
        self._members += 2
        return ImageResult(
            task.id, task.k, self.store.uri(self.key), sha256_hex(data), len(data), encode_s, None
        )

    def finish(self) -> StoredShard:
        """Wait for every image, close the tar and store it whole. Raises ShardStoreError if an
        image or the tar could not be stored; then nothing of the shard is visible."""
        try:
            results = self._pool.drain()
            if self._members == 0:  # every row failed: no tar
                return StoredShard(results)
            self._tar.close()  # writes the end-of-archive blocks
            size = self._spool.tell()
            self._spool.seek(0)
            start = time.perf_counter()
            try:
                self.store.put_file(self.key, self._spool, TAR_CONTENT_TYPE)
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
        """Drop the tar being built. Nothing was stored yet (the tar goes up whole in `finish`),
        so nothing partial is left behind."""
        self._pool.close()
        # Not self._tar.close(): that would write end blocks into a spool that is discarded.
        self._spool.close()
