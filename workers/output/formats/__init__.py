"""Output formats: one module per format (files, parquet, webdataset), each holding its writer,
its reader and the keys its objects have (its FORMAT, an OutputFormat), and the registry that
picks them: the writer by a job's `output.format`, the reader by the format's name or by the key
area an object lies in (a manifest row's uri says which), and every format's objects of a shard
by their keys (`attempt_object`, `attempt_prefixes`: orphans, supersession, verification).

A new format is one module that declares its FORMAT (name, description, ShardObjects, a writer
with `add`/`finish`/`abort`, a reader with `read`) and its row in FORMATS below; the job spec's
`output.format` choices and the knob's description come from FORMATS. Nothing that reads an
output (verify, preview, report) changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ditfleet.model.knobs import check_settings, setting
from ditfleet.workers.output.formats import files, parquet, webdataset
from ditfleet.workers.output.formats.base import (
    MANIFEST_IMAGE_COLUMNS,
    ImageTask,
    ManifestImage,
    OutputFormat,
    ShardReader,
    ShardWriter,
    StoredImageError,
    StoredShard,
    WriterSettings,
    ok_images,
)
from ditfleet.workers.output.layout import AttemptObject
from ditfleet.workers.output.upload_pool import ImageResult, ShardStoreError, UploadPool
from ditfleet.workers.storage.base import ObjectStore

__all__ = [
    "FORMATS",
    "FORMAT_AREAS",
    "FORMAT_NAMES",
    "MANIFEST_IMAGE_COLUMNS",
    "READERS",
    "AttemptObject",
    "FormatName",
    "ImageResult",
    "ImageTask",
    "ManifestImage",
    "OutputFormat",
    "ShardStoreError",
    "ShardWriterConfig",
    "StoredImageError",
    "StoredShard",
    "UploadPool",
    "WriterSettings",
    "attempt_object",
    "attempt_prefixes",
    "make_shard_writer",
    "object_key",
    "ok_images",
    "read_images",
    "reader_for_key",
]

# The output formats, one row each.
FORMATS: tuple[OutputFormat, ...] = (files.FORMAT, parquet.FORMAT, webdataset.FORMAT)

FORMAT_NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS)
_BY_NAME = {f.name: f for f in FORMATS}
READERS: dict[str, ShardReader] = {f.name: f.reader for f in FORMATS}
# The key areas the formats store shard objects under (images/, data/, webdataset/).
FORMAT_AREAS: tuple[str, ...] = tuple(f.objects.area for f in FORMATS)
assert len(_BY_NAME) == len(FORMATS), f"two output formats share a name: {FORMAT_NAMES}"
assert not any(a.startswith(b) for a in FORMAT_AREAS for b in FORMAT_AREAS if a != b), "areas must not nest"
assert len(set(FORMAT_AREAS)) == len(FORMATS), f"two output formats share an area: {FORMAT_AREAS}"

# The names a job may give `output.format`: a Literal built from FORMATS, so the job spec offers
# and checks exactly the registered formats (type checkers see a str).
if TYPE_CHECKING:
    FormatName = str
else:
    FormatName = Literal[FORMAT_NAMES]


@dataclass(frozen=True)
class ShardWriterConfig(WriterSettings):
    """How a worker stores images: the format (one of FORMATS) and the writer's settings."""

    output_format: FormatName = setting(
        "files",
        fingerprint="always",
        description="; ".join(f"'{f.name}': {f.description}" for f in FORMATS) + ".",
    )

    def __post_init__(self) -> None:
        check_settings(self)  # output_format among FORMATS, image_format, every field's bounds


def attempt_object(key: str) -> AttemptObject | None:
    """The shard, attempt token and generation of an object key of any format (an image, data
    file or tar); None for any other key (outputs of earlier versions had keys without a token)."""
    for f in FORMATS:
        found = f.objects.match(key)
        if found is not None:
            return found
    return None


def attempt_prefixes(shard: int) -> tuple[str, ...]:
    """Key prefixes under which every run of `shard` writes its objects, for every format."""
    return tuple(f.objects.prefix(shard) for f in FORMATS)


def make_shard_writer(store: ObjectStore, shard: int, config: ShardWriterConfig, attempt: str) -> ShardWriter:
    """The writer of one run of `shard`; attempt: the run's token (layout.new_attempt_token)."""
    fmt = _BY_NAME.get(config.output_format)
    if fmt is None:
        raise ValueError(f"output format {config.output_format!r} is not one of {list(FORMAT_NAMES)}")
    return fmt.writer(store, shard, config, attempt)


def reader_for_key(key: str) -> ShardReader:
    """The reader of the format whose area `key` lies in."""
    for f in FORMATS:
        if key.startswith(f.objects.area):
            return f.reader
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
