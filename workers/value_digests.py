"""Fixed-width digests of strings (ids, prompts), computed column-wise in numpy (no Python object per row).

A digest is a 64-bit mix of a string's UTF-8 bytes and its length, read eight bytes at a time
straight from the Arrow buffers. It only has to spread ids evenly: two rows with equal digests
are compared by their real ids afterwards (driver.input.duplicate_ids), so a collision costs a
second look, never a wrong answer. `bits` below 64 keeps the low bits only; tests use it to
force collisions.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ditfleet.workers.content_digest import plain_array, string_offsets

_MASK64 = (1 << 64) - 1
_SEED = np.uint64(0x9E3779B97F4A7C15)
_MUL = np.uint64(0xFF51AFD7ED558CCD)
_MUL2 = np.uint64(0xC4CEB9FE1A85EC53)
_STEP = np.uint64(0x100000001B3)
_NULL_SALT = np.uint64(0xD6E8FEB86659FD93)
_S33 = np.uint64(33)


def mix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: every input bit affects every output bit (also for callers
    that combine digests, e.g. of a row's columns)."""
    h = h ^ (h >> _S33)
    h = h * _MUL
    h = h ^ (h >> _S33)
    h = h * _MUL2
    return h ^ (h >> _S33)


def _as_string(values: pa.Array) -> pa.Array:
    values = plain_array(values)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    if pa.types.is_string_view(values.type):
        return values.cast(pa.large_string())
    return values.cast(pa.string())  # integers in decimal: 7 and "7" are the same id


def digests(values: pa.Array, bits: int = 64, positions: np.ndarray | None = None) -> np.ndarray:
    """One uint64 digest per value (strings as they are, integers in decimal).

    A null gets a digest of its position (`positions`, else its index) salted apart from the
    strings, so nulls do not pile up as one repeated digest; they are never duplicates.
    """
    values = _as_string(values)
    if len(values) == 0:
        return np.empty(0, np.uint64)
    offsets = string_offsets(values)
    base, end = int(offsets[0]), int(offsets[-1])
    data = np.zeros(0, np.uint8)  # strings all empty: there may be no data buffer
    if end > base:
        data = np.frombuffer(values.buffers()[2], np.uint8, count=end - base, offset=base)
    lengths = offsets[1:] - offsets[:-1]
    h = (lengths.astype(np.uint64) * _STEP) ^ _SEED
    longest = int(lengths.max())
    if longest == int(lengths.min()) and longest:
        h = _mix_one_length(h, data, longest)
    else:
        h = _mix_ragged(h, data, offsets[:-1] - base, lengths)
    return _finish(values, h, bits, positions)


def _mix_one_length(h: np.ndarray, data: np.ndarray, length: int) -> np.ndarray:
    """Ids of one length (most id schemes): the bytes are an n x length matrix; the same words
    as `_mix_ragged` reads, without gathering them."""
    block = np.zeros((len(h), -(-length // 8) * 8), np.uint8)
    block[:, :length] = data.reshape(len(h), length)
    for column in block.view("<u8").T:
        h = mix((h * _STEP) ^ column)
    return h


def _mix_ragged(h: np.ndarray, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Strings of any lengths, eight bytes at a time from each one's start."""
    # Two words of zero padding: the last string's final read and its next word stay in bounds.
    padded = np.zeros(len(data) // 8 * 8 + 16, np.uint8)
    padded[: len(data)] = data
    words = padded.view("<u8")
    for word_at in range(0, int(lengths.max()), 8):
        # Whole-column steps while most strings still have bytes here (ids of one format have
        # one length); the stragglers of a few long ids are gathered by index.
        rest = lengths - word_at
        live = rest > 0
        dense = word_at == 0 or np.count_nonzero(live) * 2 > len(h)
        idx = None if dense else np.flatnonzero(live)
        at = starts + word_at if dense else starts[idx] + word_at
        rest = rest if dense else rest[idx]
        # Finished strings' reads (discarded below) are kept inside the buffer.
        q, r = np.minimum(at >> 3, len(words) - 2), ((at & 7) * 8).astype(np.uint64)
        lo = words[q] >> r
        hi = (words[q + 1] << ((np.uint64(64) - r) & np.uint64(63))) * (r != 0)
        shift = np.clip(rest, 0, 8).astype(np.uint64) * np.uint64(8)
        keep = np.where(
            shift == 64, np.uint64(_MASK64), (np.uint64(1) << (shift & np.uint64(63))) - np.uint64(1)
        )
        if dense:
            mixed = mix((h * _STEP) ^ ((lo | hi) & keep))
            h = np.where(live, mixed, h)
        else:
            h[idx] = mix((h[idx] * _STEP) ^ ((lo | hi) & keep))
    return h


def _finish(values: pa.Array, h: np.ndarray, bits: int, positions: np.ndarray | None) -> np.ndarray:
    out = mix(h)
    if values.null_count:
        nulls = np.asarray(values.is_null().to_numpy(zero_copy_only=False))
        where = positions[nulls] if positions is not None else np.flatnonzero(nulls)
        out[nulls] = mix(where.astype(np.uint64) ^ _NULL_SALT)
    if bits < 64:
        out &= np.uint64((1 << bits) - 1)
    return out


def position_digests(first_position: int, n: int, bits: int = 64) -> np.ndarray:
    """Digests of the ids of rows without an id column: their positions, in decimal."""
    as_text = pa.array(np.arange(first_position, first_position + n, dtype=np.int64)).cast(pa.string())
    return digests(as_text, bits)
