"""What every output format shares: the writer's config, the image task, the stored-shard result,
the writer protocol and the encode step.

Each writer takes images one at a time (`add`), encodes and stores them on a bounded UploadPool,
and `finish` returns one ImageResult per image, in the order added. Nothing here writes the
manifest: the caller turns results into manifest rows and commits them after `finish`
returned, i.e. after every image is durably stored.

Every writer is made for one run of one shard and writes only keys that carry the run's attempt
token (layout.image_key, data_key, webdataset_key): no two runs of a shard ever write the same
key, so whatever a losing, late or killed run uploads, the objects the committed manifest names
stay exactly as they were committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from workers.output.codec import encode_image, extension, to_uint8_hwc
from workers.output.upload_pool import ImageResult

_MiB = 1024 * 1024
# The formats a job may name; the registry in workers.output.formats maps each to its writer.
FORMAT_NAMES = ("files", "parquet", "webdataset")


@dataclass(frozen=True)
class ShardWriterConfig:
    """How a worker stores images. Sizes in bytes."""

    output_format: str = "files"  # one of FORMAT_NAMES
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
        if self.output_format not in FORMAT_NAMES:
            raise ValueError(f"output format {self.output_format!r} is not one of {list(FORMAT_NAMES)}")
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


def encode_task_image(cfg: ShardWriterConfig, image: Any) -> tuple[bytes | None, float, str | None, int, int]:
    """(encoded bytes or None, encode seconds, error, width, height). Encode problems fail the
    row only."""
    start = time.perf_counter()
    try:
        pixels = to_uint8_hwc(image)  # (H, W, 3) uint8
        data = encode_image(pixels, cfg.image_format, cfg.quality, cfg.png_compress_level)
    except Exception as e:  # non-finite output, bad shape, a codec error: this row only
        return None, time.perf_counter() - start, f"encode failed: {type(e).__name__}: {e}", 0, 0
    return data, time.perf_counter() - start, None, pixels.shape[1], pixels.shape[0]
