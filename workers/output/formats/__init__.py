"""Output formats: one module per format (files, parquet, webdataset), each holding its writer,
and the registry that picks the writer a job's `output.format` names. A new format is one module
with a class that has `add`/`finish`/`abort`, a name in base.FORMAT_NAMES and an entry here.
"""

from __future__ import annotations

from collections.abc import Callable

from workers.output.formats.base import (
    FORMAT_NAMES,
    ImageTask,
    ShardWriter,
    ShardWriterConfig,
    StoredShard,
)
from workers.output.formats.files import FilesShardWriter
from workers.output.formats.parquet import DATA_SCHEMA, ParquetShardWriter
from workers.output.formats.webdataset import WebDatasetShardWriter
from workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from workers.storage.base import ObjectStore

__all__ = [
    "DATA_SCHEMA",
    "FORMAT_NAMES",
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
    "WebDatasetShardWriter",
    "make_shard_writer",
]

OUTPUT_FORMATS: dict[str, Callable[[ObjectStore, int, ShardWriterConfig, str], ShardWriter]] = {
    "files": FilesShardWriter,
    "parquet": ParquetShardWriter,
    "webdataset": WebDatasetShardWriter,
}
assert tuple(OUTPUT_FORMATS) == FORMAT_NAMES, "a format needs a name in FORMAT_NAMES and a writer here"


def make_shard_writer(store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> ShardWriter:
    """The writer of one run of `shard`; attempt: the run's token (layout.new_attempt_token)."""
    return OUTPUT_FORMATS[config.output_format](store, shard, config, attempt)
