"""Writing a shard's images: output format "files" (one object per image), "parquet" (one
data file per shard, images embedded as the Hugging Face datasets Image struct) or
"webdataset" (one tar per shard, see webdataset_writer.py).

Each takes images one at a time (`add`), encodes and stores them on a bounded UploadPool, and
`finish` returns one ImageResult per image, in the order added. Nothing here writes the
manifest: the caller turns results into manifest rows and commits them after `finish`
returned, i.e. after every image is durably stored. A new format is one more class with
`add`/`finish`/`abort` and an entry in OUTPUT_FORMATS.

Every writer is made for one run of one shard and writes only keys that carry the run's attempt
token (layout.image_key, data_key, webdataset_key): no two runs of a shard ever write the same
key, so whatever a losing, late or killed run uploads, the objects the committed manifest names
stay exactly as they were committed.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from workers.image_codec import content_type, encode_image, extension, sha256_hex, to_uint8_hwc
from workers.layout import data_key, image_file_name, image_index_in_key, image_key
from workers.stores import ObjectStore
from workers.upload_pool import ImageResult, ShardStoreError, UploadPool

__all__ = [
    "DATA_SCHEMA",
    "OUTPUT_FORMATS",
    "FilesShardWriter",
    "ImageResult",
    "ImageTask",
    "ParquetShardWriter",
    "ShardStoreError",
    "ShardWriter",
    "ShardWriterConfig",
    "StoredShard",
    "UploadPool",
    "make_shard_writer",
]

_MiB = 1024 * 1024
PARQUET_CONTENT_TYPE = "application/vnd.apache.parquet"


@dataclass(frozen=True)
class ShardWriterConfig:
    """How a worker stores images. Sizes in bytes."""

    output_format: str = "files"  # a key of OUTPUT_FORMATS
    image_format: str = "png"  # png | webp | jpeg
    quality: int | None = None  # webp/jpeg quality 1..100 (None = the codec's default)
    png_compress_level: int = 6
    max_in_flight: int = 32  # images held by the pool at once: the memory bound
    threads: int = 8  # encode+upload threads
    row_group_rows: int = 64  # "parquet": a row group closes at this many images ...
    row_group_bytes: int = 64 * _MiB  # ... or this many image bytes, whichever comes first
    spool_max_bytes: int = 256 * _MiB  # "parquet"/"webdataset": the file spills to a temp file above this
    tmp_dir: str | None = None  # where it spills (None = the system's temp dir)

    def __post_init__(self) -> None:
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output format {self.output_format!r} is not one of {sorted(OUTPUT_FORMATS)}")
        extension(self.image_format)  # validates
        for name in ("max_in_flight", "threads", "row_group_rows", "row_group_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShardWriterConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ImageTask:
    """One image to store and what the "parquet" format keeps next to it."""

    id: str
    k: int = 0
    num_images: int = 1  # images of this row; with 1 the file name carries no _k suffix
    prompt: str = ""
    negative_prompt: str | None = None
    seed: int = 0
    extra: str | None = None  # pass-through columns as JSON (manifest.passthrough_json)


@dataclass(frozen=True)
class StoredShard:
    """What `finish` returns: one result per image (order of `add`), the data file if any."""

    results: list[ImageResult]
    data_uri: str | None = None  # "parquet" and "webdataset" formats
    data_bytes: int = 0
    data_upload_s: float = 0.0
    keys: tuple[str, ...] = ()  # every key this run stored (all carry its attempt token)


class ShardWriter(Protocol):
    def add(self, task: ImageTask, image: Any) -> None:
        """Hand over one image ((3, H, W) float in [0, 1] or (H, W, 3) uint8); may block."""

    def finish(self) -> StoredShard:
        """Wait until every image is stored; raises ShardStoreError if one could not be."""

    def abort(self) -> None:
        """Stop and drop what is not yet stored; leaves no partial object behind."""


def _encode(cfg: ShardWriterConfig, image: Any) -> tuple[bytes | None, float, str | None, int, int]:
    """(encoded bytes or None, encode seconds, error, width, height). Encode problems fail the
    row only."""
    start = time.perf_counter()
    try:
        pixels = to_uint8_hwc(image)  # (H, W, 3) uint8
        data = encode_image(pixels, cfg.image_format, cfg.quality, cfg.png_compress_level)
    except Exception as e:  # non-finite output, bad shape, a codec error: this row only
        return None, time.perf_counter() - start, f"encode failed: {type(e).__name__}: {e}", 0, 0
    return data, time.perf_counter() - start, None, pixels.shape[1], pixels.shape[0]


class FilesShardWriter:
    """One object per image at layout.image_key(shard, attempt, id, k, ext)."""

    def __init__(self, store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> None:
        self.store, self.shard, self.config, self.attempt = store, shard, config, attempt
        self._ext = extension(config.image_format)
        self._mime = content_type(config.image_format)
        self._pool = UploadPool(config.max_in_flight, config.threads)
        self._keys: list[str] = []  # appended by the pool's threads (list.append is atomic)

    def add(self, task: ImageTask, image: Any) -> None:
        key = image_key(self.shard, self.attempt, task.id, image_index_in_key(task.k, task.num_images), self._ext)
        self._pool.submit(self.store.uri(key), lambda: self._store_one(key, task, image))

    def _store_one(self, key: str, task: ImageTask, image: Any) -> ImageResult:
        data, encode_s, error, _, _ = _encode(self.config, image)
        if data is None:
            return ImageResult(task.id, task.k, encode_s=encode_s, error=error)
        start = time.perf_counter()
        self.store.put(key, data, self._mime)  # raises after the store's retries: shard fails
        self._keys.append(key)
        upload_s = time.perf_counter() - start
        return ImageResult(
            task.id, task.k, self.store.uri(key), sha256_hex(data), len(data), encode_s, upload_s
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
            lambda: (task, name, *_encode(self.config, image)),
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


def _webdataset_writer(store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> ShardWriter:
    # Imported here, not at the top: webdataset_writer builds on this module's ImageTask,
    # StoredShard and _encode, so a top-level import would be circular.
    from workers.webdataset_writer import WebDatasetShardWriter

    return WebDatasetShardWriter(store, shard, config, attempt)


OUTPUT_FORMATS: dict[str, Callable[[ObjectStore, int, ShardWriterConfig, str], ShardWriter]] = {
    "files": FilesShardWriter,
    "parquet": ParquetShardWriter,
    "webdataset": _webdataset_writer,  # workers/webdataset_writer.py: one tar per shard
}


def make_shard_writer(store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> ShardWriter:
    """The writer of one run of `shard`; attempt: the run's token (layout.new_attempt_token)."""
    return OUTPUT_FORMATS[config.output_format](store, shard, config, attempt)
