"""Output format "parquet": one data file per run of a shard, images embedded as the Hugging Face
datasets Image struct (load_dataset yields PIL images without a cast)."""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from workers.output.codec import extension, sha256_hex
from workers.output.formats.base import ImageTask, ShardWriterConfig, StoredShard, encode_task_image
from workers.output.layout import data_key, image_file_name, image_index_in_key
from workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from workers.storage.base import ObjectStore

PARQUET_CONTENT_TYPE = "application/vnd.apache.parquet"

IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])

# All fields nullable: `datasets` only applies its features to fields equal to its own
# (always nullable) ones, so a non-nullable "image" would load as a plain dict.
DATA_SCHEMA = pa.schema(
    [
        pa.field("image", IMAGE_STRUCT),
        pa.field("id", pa.string()),
        pa.field("k", pa.int32()),
        pa.field("prompt", pa.string()),
        pa.field("negative_prompt", pa.string()),
        pa.field("seed", pa.int64()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("sha256", pa.string()),
        pa.field("extra", pa.string()),
    ],
    # `datasets` reads its features from this key, so load_dataset yields PIL images for
    # "image" without a cast_column.
    metadata={
        "huggingface": json.dumps(
            {
                "info": {
                    "features": {
                        "image": {"_type": "Image"},
                        "id": {"dtype": "string", "_type": "Value"},
                        "k": {"dtype": "int32", "_type": "Value"},
                        "prompt": {"dtype": "string", "_type": "Value"},
                        "negative_prompt": {"dtype": "string", "_type": "Value"},
                        "seed": {"dtype": "int64", "_type": "Value"},
                        "width": {"dtype": "int32", "_type": "Value"},
                        "height": {"dtype": "int32", "_type": "Value"},
                        "sha256": {"dtype": "string", "_type": "Value"},
                        "extra": {"dtype": "string", "_type": "Value"},
                    }
                }
            }
        )
    },
)
_NOT_IMAGE = [f.name for f in DATA_SCHEMA if f.name != "image"]


class ParquetShardWriter:
    """One Parquet file per run of a shard at layout.data_key(shard, attempt), rows in the order added.

    Row groups are streamed into a spooled temp file (memory up to `spool_max_bytes`, then
    disk), and the finished file goes to the store in one whole-object write, so a reader never
    sees part of it and the shard never sits in memory whole. Failed rows are not in the data
    file (the manifest has them).
    """

    def __init__(self, store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> None:
        self.store, self.shard, self.config = store, shard, config
        self.key = data_key(shard, attempt)
        self._ext = extension(config.image_format)
        self._spool = tempfile.SpooledTemporaryFile(max_size=config.spool_max_bytes, dir=config.tmp_dir)
        self._writer: pq.ParquetWriter | None = None
        self._rows: list[dict[str, Any]] = []
        self._row_bytes = 0
        self._stored_rows = 0
        # Encoding runs on the pool; appending to the one file happens in order on this thread.
        self._pool = UploadPool(config.max_in_flight, config.threads, on_result=self._append, ordered=True)

    def add(self, task: ImageTask, image: Any) -> None:
        name = image_file_name(task.id, image_index_in_key(task.k, task.num_images), self._ext)
        self._pool.submit(
            f"{self.store.uri(self.key)} row {task.id!r} k={task.k}",
            lambda: (task, name, *encode_task_image(self.config, image)),
        )

    def _append(self, value: tuple[ImageTask, str, bytes | None, float, str | None, int, int]) -> ImageResult:
        task, name, data, encode_s, error, width, height = value
        if data is None:
            return ImageResult(task.id, task.k, encode_s=encode_s, error=error)
        digest = sha256_hex(data)
        self._rows.append(
            {
                "image": {"bytes": data, "path": name},
                "id": task.id,
                "k": task.k,
                "prompt": task.prompt,
                "negative_prompt": task.negative_prompt,
                "seed": task.seed,
                "width": width,
                "height": height,
                "sha256": digest,
                "extra": task.extra,
            }
        )
        self._row_bytes += len(data)
        if len(self._rows) >= self.config.row_group_rows or self._row_bytes >= self.config.row_group_bytes:
            self._flush()
        return ImageResult(task.id, task.k, self.store.uri(self.key), digest, len(data), encode_s, None)

    def _flush(self) -> None:
        if not self._rows:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(
                self._spool,
                DATA_SCHEMA,
                compression={
                    "image.bytes": "NONE",
                    **{name: "ZSTD" for name in _NOT_IMAGE},
                    "image.path": "ZSTD",
                },
                # Images are already compressed; dictionaries and min/max statistics of image
                # bytes only cost time and footer size.
                use_dictionary=["id", "prompt", "negative_prompt", "image.path"],
                write_statistics=[*_NOT_IMAGE, "image.path"],
            )
        self._writer.write_table(pa.Table.from_pylist(self._rows, schema=DATA_SCHEMA))
        self._stored_rows += len(self._rows)
        self._rows, self._row_bytes = [], 0

    def finish(self) -> StoredShard:
        try:
            results = self._pool.drain()
            self._flush()
            if self._writer is None:  # every row failed: no data file
                return StoredShard(results)
            self._writer.close()
            size = self._spool.tell()
            self._spool.seek(0)
            start = time.perf_counter()
            try:
                self.store.put_file(self.key, self._spool, PARQUET_CONTENT_TYPE)
            except Exception as e:
                raise ShardStoreError(
                    f"{self.store.uri(self.key)} could not be stored: {type(e).__name__}: {e}"
                ) from e
            return StoredShard(
                results, self.store.uri(self.key), size, time.perf_counter() - start, (self.key,)
            )
        finally:
            self.abort()

    def abort(self) -> None:
        self._pool.close()
        self._rows = []
        self._spool.close()
