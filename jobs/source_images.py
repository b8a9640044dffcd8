"""An edit job's source images read back for `ditfleet preview` and `ditfleet report`, by the
URIs the manifest names them with (`source_uris`).

A URI is read where it points: `s3://bucket/key` through workers.storage (the command's S3
options), an absolute path from the local disk, and `<input file>#row=<n>&image=<i>` (a source
embedded in the input as the `datasets` image struct) from that row of the input
Parquet's `input.image_column` (the job's, from `_job.json`), reading only that column of that
row's row group. A source that cannot be shown (gone, unreadable, not an image, a relative name
that says nothing of where it is) is a `SourceImage` with
no image and the reason: the sheet and the page draw a labelled blank, never fail.
"""

from __future__ import annotations

import io
import re
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ditfleet.driver.output.job_file import read_job_file
from ditfleet.workers.storage import ObjectStore, S3Config, open_store
from ditfleet.workers.storage.input_files import S3_SCHEME, filesystem_for, is_s3, open_parquet

# A source larger than this is not drawn (a thumbnail needs no more; an edit job's own limit,
# input.max_source_mb, is 64 MiB by default).
MAX_SOURCE_BYTES = 64 * 2**20
_EMBEDDED = re.compile(r"^(?P<file>.+)#row=(?P<row>\d+)&image=(?P<image>\d+)$")


@dataclass(frozen=True)
class SourceImage:
    """One source of an edited image: decoded (RGB), or None with why it is not shown."""

    uri: str
    image: Image.Image | None
    problem: str | None = None


@dataclass
class SourceImages:
    """Reads sources by URI; one store per bucket, reused. `image_column`: the job's
    input.image_column (embedded sources are read from it); `s3`: the command's S3 options."""

    s3: S3Config = field(default_factory=S3Config)
    image_column: str | None = None
    max_bytes: int = MAX_SOURCE_BYTES
    _stores: dict[str, ObjectStore] = field(default_factory=dict)

    def read(self, uris: Sequence[str]) -> tuple[SourceImage, ...]:
        return tuple(self.read_one(uri) for uri in uris)

    def read_one(self, uri: str) -> SourceImage:
        try:
            data = self._bytes(uri)
        except Exception as e:  # noqa: BLE001 - whatever the store says: a labelled blank, not a crash
            return SourceImage(uri, None, _problem(e))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as im:
                    im.draft("RGB", (512, 512))  # a JPEG decodes at a fraction of its size: a thumbnail's
                    return SourceImage(uri, im.convert("RGB"))
        except Exception as e:  # noqa: BLE001 - not an image, damaged, too large to decode
            return SourceImage(uri, None, f"not an image ({type(e).__name__})")

    def _bytes(self, uri: str) -> bytes:
        embedded = _EMBEDDED.match(uri)
        if embedded:
            return self._embedded(embedded["file"], int(embedded["row"]), int(embedded["image"]))
        if is_s3(uri):
            bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = open_store(f"{S3_SCHEME}{bucket}", self.s3)
            capped = _Capped(self.max_bytes)
            store.get_file(key, capped)  # streamed: stops at the cap
            return capped.getvalue()
        if not uri.startswith("/"):
            raise _NotShown("a relative name, which says nothing of where it is")
        with open(uri, "rb") as f:
            capped = _Capped(self.max_bytes)
            shutil.copyfileobj(f, capped)
        return capped.getvalue()

    def _embedded(self, input_file: str, row: int, image: int) -> bytes:
        if not self.image_column:
            raise _NotShown("embedded in the input, whose image column _job.json does not name")
        fs = filesystem_for(input_file, endpoint_url=self.s3.endpoint_url, region=self.s3.region)
        with open_parquet(fs, input_file) as parquet:
            start = 0
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if row < start + rows:
                    column = parquet.read_row_group(group, columns=[self.image_column]).column(0)
                    return _struct_bytes(column[row - start].as_py(), image)
                start += rows
        raise _NotShown(f"the input has no row {row}")


def source_reader(output: ObjectStore, s3: S3Config | None = None) -> SourceImages:
    """The reader of an output's sources: `s3` (the command's S3 options) and the job's
    input.image_column from its `_job.json` (none there: embedded sources are not drawn)."""
    try:
        job = read_job_file(output) or {}
    except ValueError:  # a damaged _job.json: the sheet is still drawn, embedded sources blank
        job = {}
    spec = job.get("spec")
    section = spec.get("input") if isinstance(spec, dict) else None
    column = section.get("image_column") if isinstance(section, dict) else None
    return SourceImages(s3 or S3Config(), column if isinstance(column, str) else None)


class _NotShown(Exception):
    """A source this reader does not draw, and why (the message)."""


class _Capped(io.BytesIO):
    """A file to stream a source into that refuses more than `limit` bytes, so a huge source is
    not read whole to draw a thumbnail."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.limit:
            raise _NotShown(f"over {self.limit / 2**20:g} MiB, not drawn")
        return super().write(data)


def _struct_bytes(value: Any, image: int) -> bytes:
    values = value if isinstance(value, list) else [value]
    if image >= len(values) or not isinstance(values[image], dict) or not values[image].get("bytes"):
        raise _NotShown(f"the input row has no embedded image {image}")
    return bytes(values[image]["bytes"])


def _problem(e: Exception) -> str:
    if isinstance(e, _NotShown):
        return str(e)
    if isinstance(e, FileNotFoundError):  # ObjectNotFound too
        return "missing"
    return f"unreadable ({type(e).__name__})"
