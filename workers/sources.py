"""An edit job's source images: where a row's sources are, what identifies them, and their bytes.

A row of an edit job names one or more source images in `input.image_column` (RowConfig), in
one of four forms: a string (a URI: "s3://bucket/key", an absolute path, or a path relative to
the input file's folder), a list of strings, the Hugging Face `datasets` image struct
`{bytes, path}` (bytes embedded in the row; a struct without bytes names its `path` as a URI),
or a list of those. `column_problem` checks the column's type, `column_sources` turns its values
into `SourceRef`s, column-wise per batch, for the validator, the planner and the worker alike.

What each source is, is decided from its header alone (`SourceReader.header`: a local file's
first bytes, a ranged GET of an S3 object through workers.storage, or the embedded bytes): its
size (the row's bucket when it gives none), its identity (embedded: the sha256 of its bytes; a
URI: its size and ETag, or its size and mtime in nanoseconds) and whether it is usable (there,
readable, an image, within the size limits). The planner records the identities in the shard's
content digest (workers.content_digest.IdentityDigest) and the worker checks them again before
it generates, so a source changed after planning refuses the shard like an edited prompt row.
The whole image is read only by the actor that edits it (`SourceReader.fetch`, called by
workers.source_prefetch off the GPU's path), checked against the identity planned.

Torch-free (pyarrow and Pillow): the driver imports it.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from PIL import Image, ImageOps, UnidentifiedImageError

from ditfleet.model.family import EDIT, source_size
from ditfleet.workers.storage.base import (
    ObjectNotFound,
    ObjectRead,
    ObjectStore,
    ObjectUnreadable,
    S3Config,
)
from ditfleet.workers.storage.input_files import S3_SCHEME, is_s3
from ditfleet.workers.storage.open import open_store

# A header read takes this many bytes first (every format's size field is in its first few
# hundred bytes, a JPEG's after its EXIF segments, which are 64 KiB at most each) and, when Pillow
# cannot tell the size from them, up to HEADER_MAX_BYTES before it calls the file not an image.
HEADER_BYTES = 64 * 1024
HEADER_MAX_BYTES = 1024 * 1024

# Header reads of S3 sources at once: each waits ~10-50 ms on the network; S3Config's default
# connection pool (max_pool_connections) holds this many.
S3_READ_THREADS = 32

# Identities of sources that have none of their own; a source that appears later changes it.
MISSING = "missing"
UNREADABLE = "unreadable"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_EMBEDDED_FIELDS = ("bytes", "path")


class SourceSpecError(ValueError):
    """A row's image column value that names no readable source (a validation error)."""


class SourceChanged(RuntimeError):
    """A source whose bytes are not the ones planned (the shard is refused, never a row)."""


@dataclass(frozen=True)
class SourceLimits:
    """The largest source a row may name: bytes as stored, pixels decoded."""

    max_bytes: int
    max_pixels: int


@dataclass(frozen=True)
class SourceRef:
    """One source of a row: its URI (resolved: s3://..., an absolute path; an embedded source
    "<input file>#row=<n>&image=<i>") and, for an embedded one, its bytes."""

    uri: str
    data: bytes | None = None


@dataclass(frozen=True)
class SourceHeader:
    """What a source's header says: its identity, its size (pixels, as displayed: EXIF rotation
    applied) and why it cannot be used (None: usable)."""

    identity: str
    width: int | None = None
    height: int | None = None
    problem: str | None = None


@dataclass(frozen=True)
class FetchedSource:
    """A source read whole: decoded (RGB), with the sha256 of its stored bytes."""

    image: Image.Image
    sha256: str
    bytes: int


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_embedded(t: pa.DataType) -> bool:
    """The Hugging Face image struct: a `bytes` binary field and a `path` string field (either
    may be left out; at least one is there)."""
    if not pa.types.is_struct(t):
        return False
    fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
    if not set(fields) & set(_EMBEDDED_FIELDS) or set(fields) - set(_EMBEDDED_FIELDS):
        return False
    data, path = fields.get("bytes"), fields.get("path")
    binary = (
        data is None or pa.types.is_binary(data) or pa.types.is_large_binary(data) or pa.types.is_null(data)
    )
    return binary and (path is None or _is_text(path) or pa.types.is_null(path))


def column_problem(t: pa.DataType) -> str | None:
    """Why a column of type `t` cannot hold source images (None: it can)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    inner = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t
    if _is_text(inner) or _is_embedded(inner):
        return None
    return (
        f"column has type {t}; source images are a string column of URIs, a list of strings, the Hugging "
        "Face image struct {bytes: binary, path: string}, or a list of those"
    )


def resolve_uri(text: str, input_file: str) -> str:
    """A source URI as a row gives it, resolved: s3:// and absolute paths as they are (file:///
    as its path), a relative path against the input file's folder. SourceSpecError for a URI
    no store here reads (http://, gs://, ...) or an empty one."""
    text = text.strip()
    if not text:
        raise SourceSpecError("the source URI is empty")
    if is_s3(text):
        bucket, _, key = text[len(S3_SCHEME) :].partition("/")
        if not bucket or not key:
            raise SourceSpecError(f"{text!r} names no object: write s3://bucket/key")
        return text
    if text.startswith("file://"):
        path = text[len("file://") :]
        if not path.startswith("/"):
            raise SourceSpecError(f"{text!r}: a file:// URI names an absolute path (file:///path)")
        return path
    scheme = _SCHEME.match(text)
    if scheme is not None and len(scheme.group(1)) > 1:  # "C:" would be a drive, not a scheme
        raise SourceSpecError(
            f"{text!r}: the scheme {scheme.group(1)}:// cannot be read; a source is s3://bucket/key, an "
            "absolute path or a path relative to the input file (copy other sources there first)"
        )
    if text.startswith("/"):
        return os.path.normpath(text)
    if is_s3(input_file):
        bucket, _, key = input_file[len(S3_SCHEME) :].partition("/")
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(key), text))
        if joined.startswith("../") or joined == "..":
            raise SourceSpecError(f"{text!r} climbs out of the bucket {bucket}")
        return f"{S3_SCHEME}{bucket}/{joined}"
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(input_file)), text))


def _one(value: Any, input_file: str, row: int, i: int) -> SourceRef:
    if value is None:
        raise SourceSpecError(f"source {i} is null")
    if isinstance(value, str):
        return SourceRef(resolve_uri(value, input_file))
    data, path = value.get("bytes"), value.get("path")
    if data is not None:
        # Named by where its bytes are, the input row, even when the struct gives a `path`: that is
        # often a bare file name (datasets keeps the original's), which no reader can open.
        return SourceRef(f"{input_file}#row={row}&image={i}", bytes(data))
    if not path:
        raise SourceSpecError(f"source {i} has neither bytes nor a path")
    return SourceRef(resolve_uri(path, input_file))


def row_sources(value: Any, input_file: str, row: int) -> tuple[SourceRef, ...]:
    """The sources of one row's image column value (its Python form), in column order."""
    if value is None:
        raise SourceSpecError("no source image (null)")
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SourceSpecError("no source image (an empty list)")
    return tuple(_one(v, input_file, row, i) for i, v in enumerate(values))


def column_sources(
    column: pa.Array | pa.ChunkedArray, input_file: str, first_row: int
) -> list[tuple[SourceRef, ...] | SourceSpecError]:
    """Each row's sources (or why it has none usable), rows first_row.. of `input_file`."""
    out: list[tuple[SourceRef, ...] | SourceSpecError] = []
    for i, value in enumerate(column.to_pylist()):
        try:
            out.append(row_sources(value, input_file, first_row + i))
        except SourceSpecError as e:
            out.append(e)
    return out


def _probe(head: bytes) -> tuple[int, int] | None:
    """(width, height) as displayed from an image's first bytes; None when Pillow cannot tell."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(head)) as im:
                w, h = im.size
                try:
                    orientation = im.getexif().get(0x0112, 1)
                except Exception:  # noqa: BLE001 - EXIF past the header's bytes: as stored
                    orientation = 1
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)  # 5-8 turn it a quarter


class SourceReader:
    """Reads sources through workers.storage (one store per bucket, or the local root), checks
    them against `limits`. Thread-safe: a planner's or a prefetch's threads share one."""

    def __init__(self, limits: SourceLimits, s3: S3Config | None = None) -> None:
        self.limits = limits
        self.s3 = s3 or S3Config()
        self._stores: dict[str, ObjectStore] = {}
        self._lock = threading.Lock()

    def _locate(self, uri: str) -> tuple[ObjectStore, str]:
        if is_s3(uri):
            bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
            root = f"{S3_SCHEME}{bucket}"
        else:
            root, key = "/", uri.lstrip("/")
        with self._lock:
            store = self._stores.get(root)
            if store is None:
                store = self._stores[root] = open_store(root, self.s3)
        return store, key

    def _read(self, uri: str, length: int | None) -> ObjectRead:
        store, key = self._locate(uri)
        try:
            return store.read_object(key, length)
        except ValueError as e:  # a key the store refuses (a '..' or control character in it)
            raise ObjectUnreadable(str(e)) from None

    def header(self, ref: SourceRef, i: int = 0) -> SourceHeader:
        """What the source's first bytes say (`i`: its place in the row, for messages). Raises
        StoreError only for a store that failed after its retries (the caller's to retry)."""
        if ref.data is not None:
            identity = "sha256:" + hashlib.sha256(ref.data).hexdigest()
            return self._judge(ref, i, identity, len(ref.data), ref.data, ref.data)
        try:
            read = self._read(ref.uri, HEADER_BYTES)
            size_of = _probe(read.data) if read.size <= len(read.data) else None
            if size_of is None and read.size > len(read.data):
                read = self._read(ref.uri, HEADER_MAX_BYTES)
        except ObjectNotFound:
            return SourceHeader(MISSING, problem=f"source {i} ({ref.uri}) is missing")
        except ObjectUnreadable as e:
            return SourceHeader(UNREADABLE, problem=f"source {i} ({ref.uri}) cannot be read: {e}")
        return self._judge(ref, i, read.identity, read.size, read.data, None)

    def _judge(
        self, ref: SourceRef, i: int, identity: str, size: int, head: bytes, whole: bytes | None
    ) -> SourceHeader:
        limits = self.limits
        if size > limits.max_bytes:
            problem = (
                f"source {i} ({ref.uri}) is {size / 2**20:.1f} MiB, over the limit "
                f"input.max_source_mb ({limits.max_bytes // 2**20})"
            )
            return SourceHeader(identity, problem=problem)
        try:
            found = _probe(head if whole is None else whole)
        except Image.DecompressionBombError as e:  # far over any sane limit: Pillow's own guard
            return SourceHeader(identity, problem=f"source {i} ({ref.uri}) is too large to decode: {e}")
        if found is None:
            return SourceHeader(identity, problem=f"source {i} ({ref.uri}) is not an image Pillow reads")
        w, h = found
        if w * h > limits.max_pixels:
            problem = (
                f"source {i} ({ref.uri}) is {w}x{h} ({w * h / 1e6:.1f} Mpx), over the limit "
                f"input.max_source_megapixels ({limits.max_pixels / 1e6:g})"
            )
            return SourceHeader(identity, w, h, problem)
        return SourceHeader(identity, w, h)

    def fetch(self, ref: SourceRef, planned: SourceHeader, i: int = 0) -> FetchedSource:
        """The source read whole and decoded to RGB (EXIF rotation applied), after its header
        said it is usable. Raises SourceChanged when its identity is not `planned`'s, ValueError
        (naming the source) when it does not decode."""
        if ref.data is not None:
            data = ref.data
        else:
            try:
                read = self._read(ref.uri, None)
            except (ObjectNotFound, ObjectUnreadable) as e:
                raise SourceChanged(f"source {i} ({ref.uri}) can no longer be read: {e}") from None
            if read.identity != planned.identity:
                raise SourceChanged(
                    f"source {i} ({ref.uri}) changed since it was planned ({planned.identity} -> {read.identity})"
                )
            data = read.data
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as im:
                    im.load()
                    image = ImageOps.exif_transpose(im).convert("RGB")
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises fails its row
            raise ValueError(f"source {i} ({ref.uri}) cannot be decoded: {type(e).__name__}: {e}") from None
        return FetchedSource(image, hashlib.sha256(data).hexdigest(), len(data))

    def headers(self, refs: Sequence[SourceRef]) -> list[SourceHeader]:
        """Every source of a row, in order."""
        return [self.header(ref, i) for i, ref in enumerate(refs)]

    def batch_headers(self, refs: Sequence[tuple[SourceRef, ...]]) -> list[tuple[SourceHeader, ...]]:
        """The headers of many rows' sources (rows in order, each row's in column order), read
        side by side: S3 reads wait on the network (S3_READ_THREADS at once, the client's
        connection pool), local reads and embedded bytes on the CPU (a thread per core)."""
        flat = [(ref, i) for row in refs for i, ref in enumerate(row)]
        remote = any(ref.data is None and is_s3(ref.uri) for ref, _ in flat)
        threads = S3_READ_THREADS if remote else max(1, os.cpu_count() or 1)
        if len(flat) <= 1 or threads == 1:
            read = [self.header(*item) for item in flat]
        else:
            with ThreadPoolExecutor(max_workers=min(threads, len(flat))) as pool:
                read = list(pool.map(lambda item: self.header(*item), flat))
        out, at = [], 0
        for row in refs:
            out.append(tuple(read[at : at + len(row)]))
            at += len(row)
        return out


def task_problem(model_path: str, task: str, image_column: str | None) -> str | None:
    """Why a model of `task` cannot run a job with (or without) an image column; None: it can.
    An edit model edits source images, a text-to-image model has none to take."""
    if image_column is not None and task != EDIT:
        return (
            f"input.image_column is set ({image_column!r}: an edit job), but model.path {model_path!r} is a "
            f"{task} model. Point model.path at an edit model (Qwen-Image-Edit-2509, or a diffusers "
            "pipeline whose __call__ takes an image), or remove input.image_column for a text-to-image job"
        )
    if image_column is None and task == EDIT:
        return (
            f"model.path {model_path!r} is an edit model: it edits source images, which a row names. Set "
            "input.image_column to the input column that holds them (docs/edit-jobs.md), or point "
            "model.path at a text-to-image model"
        )
    return None


def planned_sources(image_column: str | None) -> tuple[tuple[int, int], ...]:
    """The sources per image the memory plan counts (model.memory Runtime.sources): for an edit
    job one source at the model's encoding size of a square, which every aspect ratio's encoding
    size is close to (the area is fixed); () for a text job. A row with more sources needs more
    memory: its batch is halved on an out-of-memory error (workers.generate)."""
    return (source_size(1, 1),) if image_column is not None else ()
