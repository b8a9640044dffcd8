"""The content digest of an input row range: what a resume compares so that a file edited in
place (same size, rows and footer) is never taken for the file an output was planned from.

The planner computes it for every shard while it validates the rows (driver.plan.ShardCutter),
the actor again over the rows it reads for that shard (workers.rows.read_shard_rows); both feed
a `RangeDigest` here, so they cannot disagree. It is a digest of values, not of Arrow buffers or
Parquet pages: the same rows written by another pyarrow version, with other compression, row
groups or batch sizes, or with the columns in another order, have the same digest.

Each column the job reads (workers.rows.content_columns) is streamed, row by row in order, into
sha256 hashers of its own (one per stream below), so cutting a range into batches anywhere gives
the same digest:
- strings and binaries: each value's length (-1 for a null) and, apart, its bytes;
- integers, booleans and temporal values as 64-bit integers, floats as float64 bits (every NaN
  as one); a null as 0 in the values and a 0 in a validity stream;
- decimals as text; lists (their lengths, then their elements), structs (field by field) and
  other types (maps, unions: their Python values' repr) row by row, each row framed by its length.
The range's digest is sha256 over the columns' names, kinds and stream digests, in name order,
cut to 64 bits. sha256 streams at about 1.6 GB/s a core (SHA extensions), and hashlib releases
the GIL on large updates, so the planner's threads hash side by side. Torch-free: the driver
imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

_NAN_BITS = np.float64("nan").view(np.uint64)


def _plain(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.DictionaryArray):
        values = values.dictionary_decode()
    return values


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
    """One batch's column in the canonical form its streams are fed from, sliceable by row."""

    def __init__(self, values: pa.Array | pa.ChunkedArray) -> None:
        values = _plain(values)
        t = values.type
        self.values = values
        self.kind: str
        if pa.types.is_null(t):
            self.kind = "null"
        elif _is_bytes(t):
            self.kind = "s"
            if pa.types.is_decimal(t):
                values = values.cast(pa.string())
            elif pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t):
                values = values.cast(pa.large_binary())
            elif pa.types.is_string_view(t):
                values = values.cast(pa.large_string())
            wide = pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)
            buffers = values.buffers()
            n = len(values)
            offsets = np.frombuffer(
                buffers[1],
                np.int64 if wide else np.int32,
                count=n + 1,
                offset=values.offset * (8 if wide else 4),
            ).astype(np.int64)
            self.offsets = offsets
            lengths = offsets[1:] - offsets[:-1]
            if values.null_count:
                lengths = np.where(_validity(values).astype(bool), lengths, -1)
            self.lengths = lengths
            self.data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
        elif (kind := _fixed_kind(t)) is not None:
            self.kind = kind
            self.valid = _validity(values)
            filled = values.fill_null(False if kind == "b" else 0) if values.null_count else values
            if kind == "f":
                floats = np.asarray(filled.cast(pa.float64()).to_numpy(zero_copy_only=False), np.float64)
                bits = floats.view(np.uint64).copy()
                bits[np.isnan(floats)] = _NAN_BITS
                self.fixed = bits
            elif kind == "u":
                self.fixed = np.asarray(filled.cast(pa.uint64()).to_numpy(zero_copy_only=False), np.uint64)
            elif kind == "b":
                self.fixed = np.asarray(filled.to_numpy(zero_copy_only=False), np.uint8)
            else:
                self.fixed = np.asarray(filled.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64)
        else:
            self.kind = f"nested:{t}"

    def parts(self, lo: int, hi: int) -> Iterator[bytes | memoryview]:
        """The bytes of rows lo..hi-1 for each of this kind's streams, in stream order."""
        if self.kind == "null":
            yield (hi - lo).to_bytes(8, "little")
        elif self.kind == "s":
            yield memoryview(self.lengths[lo:hi])
            yield self.data[int(self.offsets[lo]) : int(self.offsets[hi])]
        elif self.kind.startswith("nested:"):
            # Row by row, each framed by its length (nested columns are rare: Python is fine).
            frames = (_nested_bytes(self.values.slice(i, 1)) for i in range(lo, hi))
            yield b"".join(len(f).to_bytes(8, "little") + f for f in frames)
        else:
            yield memoryview(self.valid[lo:hi])
            yield memoryview(self.fixed[lo:hi])


def _nested_bytes(values: pa.Array) -> bytes:
    """A nested value (a one-row slice) as bytes that depend on its value only."""
    t = values.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            values = values.cast(pa.list_(t.value_type))
        offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False), np.int64)
        lengths = np.where(_validity(values).astype(bool), offsets[1:] - offsets[:-1], -1)
        child = _Column(values.flatten())
        return lengths.tobytes() + b"".join(bytes(p) for p in child.parts(0, len(child.values)))
    if pa.types.is_struct(t):
        out = [_validity(values).tobytes()]
        for field, child in zip(t, values.flatten()):
            column = _Column(child)
            out += [field.name.encode(), b"".join(bytes(p) for p in column.parts(0, len(child)))]
        return b"".join(out)
    return repr(values.to_pylist()).encode()


class RangeDigest:
    """The digest of one row range, fed batch by batch in row order (`add`), read by `value`."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[str, list]] = {}

    def add(self, columns: dict[str, _Column], lo: int, hi: int) -> None:
        """Rows lo..hi-1 of a batch prepared by `prepare`."""
        for name, column in columns.items():
            entry = self._streams.get(name)
            if entry is None or entry[0] != column.kind:
                # A column whose kind changes between batches cannot happen within one file;
                # the kind is part of the key so a mixed feed can never equal a clean one.
                entry = self._streams[name] = (column.kind, [])
            hashers = entry[1]
            for i, part in enumerate(column.parts(lo, hi)):
                if i == len(hashers):
                    hashers.append(hashlib.sha256())
                hashers[i].update(part)

    def value(self) -> int:
        h = hashlib.sha256()
        for name in sorted(self._streams):
            kind, hashers = self._streams[name]
            h.update(f"{len(name)}:{name}:{kind}:{len(hashers)}".encode())
            for s in hashers:
                h.update(s.digest())
        return int.from_bytes(h.digest()[:8], "little")


def prepare(batch: pa.RecordBatch | pa.Table, columns: Iterable[str]) -> dict[str, _Column]:
    """`columns` of `batch` in the form RangeDigest.add reads (once per batch, whatever number
    of ranges it is cut into)."""
    return {name: _Column(batch.column(name)) for name in columns}


def range_digest(batch: pa.RecordBatch | pa.Table, columns: Iterable[str]) -> int:
    """The digest of the rows `batch` holds, over `columns`."""
    digest = RangeDigest()
    digest.add(prepare(batch, columns), 0, batch.num_rows)
    return digest.value()


def combine(digests: Iterable[int]) -> int:
    """One digest for a sequence of range digests (a file's shards, in row order)."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.to_bytes(8, "little"))
    return int.from_bytes(h.digest()[:8], "little")


def hex_digest(value: int) -> str:
    """The form a digest is stored and shown in: 16 hex digits."""
    return f"{value:016x}"
