"""Output formats: one module per format (files, parquet, webdataset), each holding its writer
and its reader, and the registry that picks them: the writer by a job's `output.format`, the
reader by the format's name or by the key area an object lies in (a manifest row's uri says
which). A new format is one module with a writer (`add`/`finish`/`abort`) and a reader (`area`,
`read`), an entry in each table here, and in workers/output/layout.py (every key is built
there) its name in FORMAT_NAMES, which the job spec's `output.format` choices come from, and its
key function. Nothing that reads an output (verify, preview, report) changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ditfleet.workers.output.formats.base import (
    MANIFEST_IMAGE_COLUMNS,
    ImageTask,
    ManifestImage,
    ShardReader,
    ShardWriter,
    ShardWriterConfig,
    StoredImageError,
    StoredShard,
    ok_images,
)
from ditfleet.workers.output.formats.files import FilesShardReader, FilesShardWriter
from ditfleet.workers.output.formats.parquet import ParquetShardReader, ParquetShardWriter
from ditfleet.workers.output.formats.webdataset import WebDatasetShardReader, WebDatasetShardWriter
from ditfleet.workers.output.layout import FORMAT_NAMES
from ditfleet.workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from ditfleet.workers.storage.base import ObjectStore

__all__ = [
    "FORMAT_AREAS",
    "FORMAT_NAMES",
    "MANIFEST_IMAGE_COLUMNS",
    "READERS",
    "ImageResult",
    "ImageTask",
    "ManifestImage",
    "ShardStoreError",
    "ShardWriterConfig",
    "StoredImageError",
    "StoredShard",
    "UploadPool",
    "make_shard_writer",
    "object_key",
    "ok_images",
    "read_images",
    "reader_for_key",
]

OUTPUT_FORMATS: dict[str, Callable[[ObjectStore, int, ShardWriterConfig, str], ShardWriter]] = {
    "files": FilesShardWriter,
    "parquet": ParquetShardWriter,
    "webdataset": WebDatasetShardWriter,
}
READERS: dict[str, ShardReader] = {
    "files": FilesShardReader(),
    "parquet": ParquetShardReader(),
    "webdataset": WebDatasetShardReader(),
}
assert tuple(OUTPUT_FORMATS) == tuple(READERS) == FORMAT_NAMES, "a format needs a name, a writer and a reader"
# The key areas the formats store shard objects under (images/, data/, webdataset/).
FORMAT_AREAS = tuple(reader.area for reader in READERS.values())


def make_shard_writer(store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> ShardWriter:
    """The writer of one run of `shard`; attempt: the run's token (layout.new_attempt_token)."""
    return OUTPUT_FORMATS[config.output_format](store, shard, config, attempt)


def reader_for_key(key: str) -> ShardReader:
    """The reader of the format whose area `key` lies in."""
    for reader in READERS.values():
        if key.startswith(reader.area):
            return reader
    raise StoredImageError(f"{key} is in no output format's area {list(FORMAT_AREAS)}")


def object_key(root: str, uri: str) -> tuple[str | None, bool]:
    """(key of a manifest row's `uri` under the output root, whether the uri names another
    root). Manifests hold absolute URIs; an output that was copied or moved (`aws s3 sync`,
    `cp -r`) still names the old root, so the key is then taken from the last format-area
    component of the uri (ids are escaped, so no "/" of an id can be mistaken for one). None
    when the uri lies in no format area."""
    prefix = root.rstrip("/") + "/"
    if uri.startswith(prefix):
        return uri[len(prefix) :], False
    for area in FORMAT_AREAS:
        at = uri.rfind("/" + area)
        if at != -1:
            return uri[at + 1 :], True
    return None, True


def read_images(store: ObjectStore, rows: Iterable[ManifestImage]) -> Iterator[tuple[ManifestImage, bytes]]:
    """Each row's stored image bytes, in the order given, reading each object once (a shard's
    data file or tar holds all its images). Raises ObjectNotFound for a missing object and
    StoredImageError naming the object (and row or member) for anything else."""
    root = store.uri()
    keyed: list[tuple[str, ManifestImage]] = []
    by_key: dict[str, list[ManifestImage]] = {}
    for row in rows:
        key, _ = object_key(root, row.uri)
        if key is None:
            raise StoredImageError(f"image {row.uri} is not inside the output {root}; was the output moved?")
        keyed.append((key, row))
        by_key.setdefault(key, []).append(row)
    stored = {key: reader_for_key(key).read(store, key, named) for key, named in by_key.items()}
    for key, row in keyed:
        yield row, stored[key].image(row)
