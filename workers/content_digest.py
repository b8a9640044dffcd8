"""The content digest of an input row range: what a resume compares so that a file edited in
place (same size, rows and footer) is never taken for the file an output was planned from.

The planner computes it for every shard while it validates the rows (driver.plan.ShardCutter),
the actor again over the rows it reads for that shard (workers.rows.read_shard_rows); both feed
a `RangeDigest` here, so they cannot disagree. It is a digest of values, not of Arrow buffers or
Parquet pages: the same rows written by another pyarrow version, with other compression, row
groups or batch sizes, or with the columns in another order, have the same digest.

Each column the job reads (workers.rows.content_columns) is streamed row by row, in order, into
sha256 hashers, so cutting a range into batches anywhere gives the same digest. Per row, every
fixed-width value of the row goes into one stream (the columns in name order), and each string
or nested column's bytes into one of its own:
- strings and binaries: each value's length (-1 for a null) in the fixed-width stream, its bytes
  in the column's own;
- integers, booleans and temporal values as 64-bit integers, floats as float64 bits (every NaN
  as one), each after a validity flag (a null's value is 0);
- decimals as text; a list's length per row, its elements as a column of their own streamed over
  the rows' element range; a struct's fields as columns; other types (maps, unions) row by row
  as their Python values' repr, each framed by its length.
The range's digest is sha256 over the columns' names and kinds and the streams' digests, cut to
64 bits. sha256 streams at about 1.6 GB/s a core (SHA extensions), and hashlib releases
the GIL on large updates, so the planner's threads hash side by side. Torch-free: the driver
imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

_NAN_BITS = np.float64("nan").view(np.uint64)


def plain_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One array of the values themselves: chunks combined, a dictionary decoded."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.DictionaryArray):
        values = values.dictionary_decode()
    return values


def string_offsets(values: pa.Array) -> np.ndarray:
    """The len + 1 value offsets of a string or binary array (large or not) into its data
    buffer, as int64."""
    wide = pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)
    dtype = np.dtype(np.int64 if wide else np.int32)
    raw = np.frombuffer(
        values.buffers()[1], dtype, count=len(values) + 1, offset=values.offset * dtype.itemsize
    )
    return raw.astype(np.int64)


def _is_bytes(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_binary_view(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
    )


def _fixed_kind(t: pa.DataType) -> str | None:
    if pa.types.is_unsigned_integer(t):
        return "u"
    if pa.types.is_integer(t):
        return "i"
    if pa.types.is_boolean(t):
        return "b"
    if pa.types.is_floating(t):
        return "f"
    if pa.types.is_temporal(t):
        return f"t:{t}"  # the unit counts: 5 seconds are not 5 milliseconds
    return None


def _validity(values: pa.Array) -> np.ndarray:
    if not values.null_count:
        return np.ones(len(values), np.uint8)
    return np.asarray(values.is_valid().to_numpy(zero_copy_only=False), np.uint8)


class _Column:
    """One batch's column in canonical form: per-row fixed-width values (`fixed`, uint64 arrays,
    all of a row's go into one stream) and byte streams (`streams`) for what has no fixed width,
    a fixed number of them per kind. Nested values recurse: a list's per-row value is its length,
    its elements' fixed values and streams are streams over the element range of the rows."""

    def __init__(self, values: pa.Array | pa.ChunkedArray) -> None:
        values = plain_array(values)
        t = values.type
        self.values = values
        self.fixed: list[np.ndarray] = []
        self.offsets: np.ndarray = np.zeros(1, np.int64)  # strings: into data; lists: into the elements
        self.data = memoryview(b"")
        self.children: list[_Column] = []
        self.child_matrix: np.ndarray | None = None
        self.framed = False
        if pa.types.is_null(t):
            self.kind = "null"
        elif _is_bytes(t):
            self.kind = "s"
            self._strings(values)
        elif (kind := _fixed_kind(t)) is not None:
            self.kind = kind
            self._fixed(values, kind)
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            self.kind = f"list<{_kind_name(t.value_type)}>"
            if pa.types.is_fixed_size_list(t):
                values = values.cast(pa.list_(t.value_type))
            # Offsets into the whole child array (a slice's stay absolute), so a row range's
            # elements are one range of it; a null list's length is -1.
            self.offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False), np.int64)
            lengths = self.offsets[1:] - self.offsets[:-1]
            if values.null_count:
                lengths = np.where(_validity(values).astype(bool), lengths, -1)
            self.fixed = [lengths.view(np.uint64)]
            child = _Column(values.values)
            self.children = [child]
            if child.fixed:
                self.child_matrix = np.ascontiguousarray(np.column_stack(child.fixed))
        elif pa.types.is_struct(t):
            self.kind = "struct<" + ",".join(f"{f.name}:{_kind_name(f.type)}" for f in t) + ">"
            self.children = [_Column(c) for c in values.flatten()]
            self.fixed = [_validity(values).astype(np.uint64)] + [f for c in self.children for f in c.fixed]
        else:
            # Maps, unions, ...: row by row, each framed by its length (rare: Python is fine).
            self.kind = f"framed:{t}"
            self.framed = True

    def _strings(self, values: pa.Array) -> None:
        t = values.type
        if pa.types.is_decimal(t):
            values = values.cast(pa.string())
        elif pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t):
            values = values.cast(pa.large_binary())
        elif pa.types.is_string_view(t):
            values = values.cast(pa.large_string())
        offsets = string_offsets(values)
        lengths = offsets[1:] - offsets[:-1]
        if values.null_count:
            lengths = np.where(_validity(values).astype(bool), lengths, -1)
        self.fixed = [lengths.view(np.uint64)]
        self.offsets = offsets
        data = values.buffers()[2]
        if data is not None:
            self.data = memoryview(data)

    def _fixed(self, values: pa.Array, kind: str) -> None:
        filled = values.fill_null(False if kind == "b" else 0) if values.null_count else values
        if kind == "f":
            floats = np.asarray(filled.cast(pa.float64()).to_numpy(zero_copy_only=False), np.float64)
            bits = floats.view(np.uint64).copy()
            bits[np.isnan(floats)] = _NAN_BITS
        elif kind == "u":
            bits = np.asarray(filled.cast(pa.uint64()).to_numpy(zero_copy_only=False), np.uint64)
        elif kind == "b":
            bits = np.asarray(filled.to_numpy(zero_copy_only=False), np.uint64)
        else:
            bits = np.asarray(filled.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64).view(
                np.uint64
            )
        self.fixed = [_validity(values).astype(np.uint64), bits]

    @property
    def stream_count(self) -> int:
        if self.kind == "s" or self.framed:
            return 1
        if self.kind.startswith("list<"):
            (child,) = self.children
            return (1 if self.child_matrix is not None else 0) + child.stream_count
        return sum(c.stream_count for c in self.children)

    def streams(self, lo: int, hi: int) -> list[bytes | memoryview]:
        """The byte streams of rows lo..hi-1, stream_count of them."""
        if self.kind == "s":
            return [self.data[int(self.offsets[lo]) : int(self.offsets[hi])]]
        if self.framed:
            frames = (repr(self.values.slice(i, 1).to_pylist()).encode() for i in range(lo, hi))
            return [b"".join(len(f).to_bytes(8, "little") + f for f in frames)]
        if self.kind.startswith("list<"):
            (child,) = self.children
            a, b = int(self.offsets[lo]), int(self.offsets[hi])
            out: list[bytes | memoryview] = []
            if self.child_matrix is not None:
                out.append(_rows_bytes(self.child_matrix, a, b))
            return out + child.streams(a, b)
        return [part for c in self.children for part in c.streams(lo, hi)]


def _rows_bytes(matrix: np.ndarray, lo: int, hi: int) -> memoryview:
    """Rows lo..hi-1 of a C-contiguous matrix as bytes, without a copy."""
    return memoryview(matrix[lo:hi].reshape(-1).view(np.uint8).data)


def _kind_name(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_null(t):
        return "null"
    if _is_bytes(t):
        return "s"
    return _fixed_kind(t) or str(t)


class Prepared:
    """A batch's columns in the form RangeDigest.add reads (made once per batch, whatever number
    of ranges it is cut into): every fixed-width value in one row-major uint64 matrix (so a row
    range of them is one contiguous slice, one hash update), and the byte streams of strings and
    nested values apart."""

    def __init__(self, batch: pa.RecordBatch | pa.Table, columns: Iterable[str]) -> None:
        self.columns = [_Column(batch.column(name)) for name in sorted(columns)]
        self.layout = ";".join(f"{len(n)}:{n}:{c.kind}" for n, c in zip(sorted(columns), self.columns))
        fixed = [f for c in self.columns for f in c.fixed]
        self.matrix = (
            np.ascontiguousarray(np.column_stack(fixed))
            if fixed
            else np.zeros((batch.num_rows, 0), np.uint64)
        )
        self.stream_count = sum(c.stream_count for c in self.columns)

    def streams(self, lo: int, hi: int) -> list[bytes | memoryview]:
        return [part for c in self.columns for part in c.streams(lo, hi)]


class RangeDigest:
    """The digest of one row range, fed batch by batch in row order (`add`), read by `value`."""

    def __init__(self) -> None:
        self._layout: str | None = None
        self._hashers: list = []

    def add(self, prepared: Prepared, lo: int, hi: int) -> None:
        """Rows lo..hi-1 of a prepared batch."""
        if self._layout is None:
            self._layout = prepared.layout
            self._hashers = [hashlib.sha256() for _ in range(1 + prepared.stream_count)]
        elif self._layout != prepared.layout:
            # Batches of one file share its schema; a mixed feed must never equal a clean one.
            self._layout += "|" + prepared.layout
        self._hashers[0].update(_rows_bytes(prepared.matrix, lo, hi))
        for hasher, part in zip(self._hashers[1:], prepared.streams(lo, hi)):
            hasher.update(part)

    def value(self) -> int:
        h = hashlib.sha256((self._layout or "").encode())
        for s in self._hashers:
            h.update(s.digest())
        return int.from_bytes(h.digest()[:8], "little")


class IdentityDigest:
    """The digest of a row range's source identities (edit jobs: workers.sources), fed row by
    row in order, each row's identities in column order; combined with the rows' RangeDigest
    (`combine`), so a source changed after planning changes the shard's content digest."""

    def __init__(self) -> None:
        self._hasher = hashlib.sha256(b"sources")

    def add_row(self, identities: Iterable[str]) -> None:
        items = [i.encode() for i in identities]
        self._hasher.update(len(items).to_bytes(4, "little"))
        for item in items:  # framed: no two lists of identities feed the same bytes
            self._hasher.update(len(item).to_bytes(4, "little") + item)

    def value(self) -> int:
        return int.from_bytes(self._hasher.digest()[:8], "little")


def combine(digests: Iterable[int]) -> int:
    """One digest for a sequence of range digests (a file's shards, in row order)."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "little")


def hex_digest(value: int) -> str:
    """The form a digest is stored and shown in: 16 hex digits."""
    return f"{value:016x}"
