"""The content digest of an input row range: what a resume compares so that a file edited in
place (same size, rows and footer) is never taken for the file an output was planned from.

The planner computes it for every shard while it validates the rows (driver.plan), the actor again
over the rows it reads for that shard (workers.rows.read_shard_rows), and both call `range_digest`
here, so they cannot disagree. It is computed over values, not Arrow buffers or Parquet pages:
the same rows written by another pyarrow version, with other compression or row groups, or with
the columns in another order have the same digest.

- A column's value digest: strings and binaries by their bytes (workers.value_digests), integers,
  booleans and temporal values as their 64-bit integer, floats by their float64 bits (every NaN
  as one), decimals as text, lists and structs from their children; a null is one constant.
- A row's digest mixes its columns' value digests, each with the digest of the column's name, in
  name order; every column the job reads counts (the known ones and the pass-through ones, not
  pandas' index columns).
- A row range's digest is the sum (mod 2**64) of each row's digest mixed with its row number in
  the file, so it is the same however the range is cut into batches, and moving a row changes it.

64 bits of a non-cryptographic mix: it catches edits, not an adversary who crafts a collision
(who could as well rewrite the output). Torch-free: the driver imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from ditfleet.workers.value_digests import digests, mix

_STEP = np.uint64(0x100000001B3)
_NULL = np.uint64(0x2545F4914F6CDD1D)
_ROW_SALT = np.uint64(0x632BE59BD9B4E019)
_INDEX_SALT = np.uint64(0x8CB92BA72F3D8DD7)
_NAN_BITS = np.float64("nan").view(np.uint64)


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.int64)


def _bytes_digests(values: pa.Array) -> np.ndarray:
    """Strings and binaries by their bytes (a binary column is read as the bytes it holds)."""
    t = values.type
    if pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t):
        values = values.cast(pa.large_binary())
        t = values.type
    if pa.types.is_binary(t):
        values = values.view(pa.string())
    elif pa.types.is_large_binary(t):
        values = values.view(pa.large_string())
    return digests(values, positions=_zeros(len(values)))


def _integer_bits(values: pa.Array) -> np.ndarray:
    filled = values.fill_null(0) if values.null_count else values
    if pa.types.is_unsigned_integer(values.type):
        return np.asarray(filled.cast(pa.uint64()).to_numpy(zero_copy_only=False), np.uint64)
    return np.asarray(filled.cast(pa.int64()).to_numpy(zero_copy_only=False), np.int64).view(np.uint64)


def _float_bits(values: pa.Array) -> np.ndarray:
    floats = np.asarray(values.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False), np.float64)
    bits = floats.view(np.uint64).copy()
    bits[np.isnan(floats)] = _NAN_BITS
    return bits


def _list_digests(values: pa.Array) -> np.ndarray:
    """Each list's elements mixed with their index in it, summed: order and length both count."""
    offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False), np.int64)
    offsets = offsets - offsets[0]
    child = value_digests(values.flatten())
    lengths = offsets[1:] - offsets[:-1]
    index = np.arange(len(child), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    with np.errstate(over="ignore"):
        mixed = mix(child ^ mix(index.astype(np.uint64) ^ _INDEX_SALT))
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(mixed, dtype=np.uint64)])
        return mix((sums[offsets[1:]] - sums[offsets[:-1]]) ^ (lengths.astype(np.uint64) * _STEP))


def _struct_digests(values: pa.StructArray) -> np.ndarray:
    h = np.full(len(values), np.uint64(values.type.num_fields), np.uint64)
    for field, child in zip(values.type, values.flatten()):
        h = _combine(h, _name_digest(field.name), value_digests(child))
    return h


def _python_digests(values: pa.Array) -> np.ndarray:
    """Types without a vectorised form here (maps, unions, ...): their Python values as text."""
    text = pa.array([None if v is None else repr(v) for v in values.to_pylist()], pa.string())
    return digests(text, positions=_zeros(len(text)))


def value_digests(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One uint64 per value of `values`, equal for equal values whatever their Arrow layout."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.DictionaryArray):
        values = values.dictionary_decode()
    t, n = values.type, len(values)
    if pa.types.is_null(t):
        return np.full(n, _NULL, np.uint64)
    if pa.types.is_string_view(t):
        values, t = values.cast(pa.large_string()), pa.large_string()
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    ):
        h = _bytes_digests(values)
    elif pa.types.is_integer(t):
        h = mix(_integer_bits(values))
    elif pa.types.is_boolean(t):
        h = mix(np.asarray(values.fill_null(False).to_numpy(zero_copy_only=False), np.uint64) + _STEP)
    elif pa.types.is_floating(t):
        h = mix(_float_bits(values) ^ _ROW_SALT)
    elif pa.types.is_temporal(t):
        h = mix(_integer_bits(values.cast(pa.int64())) ^ _name_digest(str(t)))
    elif pa.types.is_decimal(t):
        text = values.cast(pa.string())
        h = digests(text, positions=_zeros(n))
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if pa.types.is_fixed_size_list(t):
            values = values.cast(pa.list_(t.value_type))
        h = _list_digests(values)
    elif pa.types.is_struct(t):
        h = _struct_digests(values)
    else:
        h = _python_digests(values)
    if values.null_count:
        nulls = np.asarray(values.is_null().to_numpy(zero_copy_only=False), bool)
        h = h.copy()
        h[nulls] = _NULL
    return h


_names: dict[str, np.uint64] = {}


def _name_digest(name: str) -> np.uint64:
    if name not in _names:
        _names[name] = np.uint64(digests(pa.array([name], pa.string()))[0])
    return _names[name]


def _combine(h: np.ndarray, name: np.uint64, column: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix((h * _STEP) ^ name ^ column)


def row_digests(batch: pa.RecordBatch | pa.Table, columns: Iterable[str]) -> np.ndarray:
    """One uint64 per row over `columns` of `batch` (in name order, each with its name)."""
    h = np.full(batch.num_rows, _ROW_SALT, np.uint64)
    for name in sorted(columns):
        h = _combine(h, _name_digest(name), value_digests(batch.column(name)))
    return h


def placed_row_digests(
    batch: pa.RecordBatch | pa.Table, first_row: int, columns: Iterable[str]
) -> np.ndarray:
    """Each row's digest mixed with its row number in the file (rows first_row.. of it): a row
    range's digest is the sum of these."""
    rows = np.arange(first_row, first_row + batch.num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix(row_digests(batch, columns) ^ mix(rows ^ _INDEX_SALT))


def range_digest(batch: pa.RecordBatch | pa.Table, first_row: int, columns: Iterable[str]) -> int:
    """The digest of rows first_row.. of a file that `batch` holds: add the digests of adjacent
    ranges (mod 2**64, `add_digests`) to get the digest of their union."""
    return int(np.sum(placed_row_digests(batch, first_row, columns), dtype=np.uint64))


def add_digests(*parts: int) -> int:
    """The digest of a union of disjoint row ranges, from theirs."""
    return sum(parts) & ((1 << 64) - 1)


def hex_digest(value: int) -> str:
    """The form a digest is stored and shown in: 16 hex digits."""
    return f"{value:016x}"
