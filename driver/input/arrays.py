"""Arrow array helpers that validation, planning and incremental planning share: plain arrays
every compute kernel accepts, and range masks that never fail on a column's integer type."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc


def plain(a: pa.Array) -> pa.Array:
    """Dictionary-encoded and view strings as plain arrays, so every kernel accepts them."""
    if isinstance(a, pa.DictionaryArray):
        a = a.dictionary_decode()
    return a.cast(pa.large_string()) if pa.types.is_string_view(a.type) else a


def outside(v: pa.Array, lo: float, hi: float) -> pa.Array:
    """v < lo or v > hi, null where v is null. Bounds are clipped to an integer column's own
    type, so a uint64 or int8 column is compared without a failing cast."""
    if pa.types.is_integer(v.type):
        bits = v.type.bit_width
        signed = pa.types.is_signed_integer(v.type)
        low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        lo_v, hi_v = pa.scalar(max(math.ceil(lo), low), v.type), pa.scalar(min(math.floor(hi), high), v.type)
        return pc.or_(pc.less(v, lo_v), pc.greater(v, hi_v))
    return pc.or_(pc.less(v, lo), pc.greater(v, hi))
