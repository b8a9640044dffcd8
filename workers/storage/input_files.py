"""Opening the prompt Parquet files, local or on S3, through one pyarrow FileSystem.

A file is named by its URI everywhere in the plan: an absolute local path, or "s3://bucket/key".
The driver and the worker both open it through a pyarrow FileSystem they are handed, so the same
code reads a laptop's file and an object in a bucket, and tests read real local files.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import NamedTuple
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

S3_SCHEME = "s3://"
_PARQUET_MAGIC = b"PAR1"


class InputFileError(ValueError):
    """An input file that cannot be opened as Parquet; the message names it and says what to do."""

    def __init__(self, uri: str, problem: str, hint: str) -> None:
        self.uri, self.problem, self.hint = uri, problem, hint
        super().__init__(f"{uri}: {problem}. {hint}.")


def is_s3(uri: str) -> bool:
    return str(uri).startswith(S3_SCHEME)


def check_s3_uri(uri: str, what: str = "location") -> str:
    """Refuse '#' and '?' in an s3:// URI, for input and output alike: URL parsing would read them
    as a fragment or a query and silently cut the key there. Returns `uri`."""
    if is_s3(uri):
        bad = sorted({c for c in "#?" if c in uri})
        if bad:
            raise ValueError(
                f"the {what} {uri} contains {' and '.join(repr(c) for c in bad)}: in an s3:// URI these "
                "start a URL fragment or query and would cut the key. Rename the prefix or objects "
                "without them (for a one-character wildcard in an input glob, use [...])"
            )
    return uri


def filesystem_for(
    uri: str, *, endpoint_url: str | None = None, region: str | None = None
) -> pafs.FileSystem:
    """The FileSystem that reads `uri`: S3 for "s3://...", else the local one.

    endpoint_url ("http://127.0.0.1:9000") points at an S3-compatible store, as for the output
    store. Credentials come from the standard AWS chain (environment, profile, instance role).
    """
    if not is_s3(uri):
        return pafs.LocalFileSystem()
    kwargs: dict[str, object] = {}
    if endpoint_url:
        parsed = urlparse(endpoint_url if "://" in endpoint_url else f"https://{endpoint_url}")
        kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        kwargs["scheme"] = parsed.scheme
        # Without a region pyarrow asks AWS where the bucket lives; a custom endpoint has no AWS.
        kwargs["region"] = region or "us-east-1"
    elif region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


def fs_path(uri: str) -> str:
    """The path of `uri` inside its FileSystem: "bucket/key" for S3, an absolute path locally."""
    if is_s3(uri):
        return uri[len(S3_SCHEME) :]
    return os.path.abspath(uri)


def to_uri(path: str, s3: bool) -> str:
    """Inverse of fs_path for a path listed by a FileSystem."""
    return S3_SCHEME + path.lstrip("/") if s3 else path


_NOT_PARQUET_HINT = (
    "Write the prompts as Parquet (e.g. pandas.read_csv('prompts.csv').to_parquet('prompts.parquet')), "
    "or point the input at the Parquet files only"
)


# Streaming reads of one shard's rows: bytes are fetched as decoding asks for them, in pieces of
# this size, so a shard stops reading at its last row instead of fetching whole column chunks.
STREAM_BUFFER_BYTES = 4 * 1024 * 1024


def open_parquet(
    filesystem: pafs.FileSystem, uri: str, stream: bool = False, metadata: pq.FileMetaData | None = None
) -> pq.ParquetFile:
    """Open `uri` for reading its footer and row groups. Call .close() (or use `with`) when done.

    stream: fetch column data as it is decoded (STREAM_BUFFER_BYTES at a time) instead of whole
    column chunks up front; for reading a part of a row group.
    metadata: the footer, read before (read_footer): not read again.
    """
    buffering = {"pre_buffer": False, "buffer_size": STREAM_BUFFER_BYTES} if stream else {}
    try:
        return pq.ParquetFile(fs_path(uri), filesystem=filesystem, metadata=metadata, **buffering)
    except FileNotFoundError as e:
        raise InputFileError(
            uri, "file not found", "Check the input path, and that the file was not moved"
        ) from e
    except (pa.ArrowInvalid, OSError) as e:
        text = str(e)
        if "magic bytes" in text or "0 bytes" in text or "size is" in text or "footer" in text.lower():
            raise InputFileError(uri, f"not a Parquet file ({text.strip()})", _NOT_PARQUET_HINT) from e
        if "not found" in text.lower() or "no such file" in text.lower():
            raise InputFileError(uri, "file not found", "Check the input path") from e
        raise InputFileError(
            uri, f"cannot be read ({text.strip()})", "Check that the file is readable"
        ) from e


def largest_row_group(metadata: pq.FileMetaData) -> int:
    """Rows in the largest row group a footer lists (0 for an empty file)."""
    return max((metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)), default=0)


class ParquetFooter(NamedTuple):
    """A file's footer, read once: what it says and the sha256 of its bytes (`footer_sha256`)."""

    metadata: pq.FileMetaData
    sha256: str


def read_footer(filesystem: pafs.FileSystem, uri: str) -> ParquetFooter:
    """The file's footer, parsed, with its sha256, from one or two small reads."""
    footer = _footer_bytes(filesystem, uri)
    framed = _PARQUET_MAGIC + footer + struct.pack("<I", len(footer)) + _PARQUET_MAGIC
    try:
        metadata = pq.read_metadata(pa.BufferReader(framed))
    except (pa.ArrowInvalid, OSError) as e:
        raise InputFileError(uri, f"not a Parquet file ({str(e).strip()})", _NOT_PARQUET_HINT) from e
    return ParquetFooter(metadata, hashlib.sha256(footer).hexdigest())


def footer_sha256(filesystem: pafs.FileSystem, uri: str) -> str:
    """sha256 of the file's Parquet footer (schema, row groups, offsets, statistics).

    The footer changes whenever the data is rewritten, so with the file size it identifies the
    content without reading all of it.
    """
    return hashlib.sha256(_footer_bytes(filesystem, uri)).hexdigest()


def _footer_bytes(filesystem: pafs.FileSystem, uri: str) -> bytes:
    try:
        f = filesystem.open_input_file(fs_path(uri))
    except FileNotFoundError as e:
        raise InputFileError(
            uri, "file not found", "Check the input path, and that the file was not moved"
        ) from e
    with f:
        size = f.size()
        if size < 12:
            raise InputFileError(uri, f"not a Parquet file (only {size} bytes)", _NOT_PARQUET_HINT)
        tail = f.read_at(8, size - 8)
        if tail[4:] != _PARQUET_MAGIC:
            raise InputFileError(
                uri, "not a Parquet file (no Parquet magic bytes at the end)", _NOT_PARQUET_HINT
            )
        (footer_len,) = struct.unpack("<I", tail[:4])
        if footer_len > size - 12:
            raise InputFileError(uri, "not a Parquet file (footer length past the start)", _NOT_PARQUET_HINT)
        return f.read_at(footer_len, size - 8 - footer_len)
