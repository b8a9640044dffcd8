"""Parquet files whose footer lies about its row counts, for tests of the input checks.

pyarrow always writes counts that match the data, so the footer is rewritten afterwards: it is
Thrift's compact protocol, decoded here into a generic tree (field id, type, value), the counts
changed, and encoded again with its new length. The data pages before it are left as written, so
a reader that trusts the footer believes the new counts while the pages hold the real rows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_MAGIC = b"PAR1"
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
# FileMetaData: 3 num_rows (i64), 4 row_groups (list<RowGroup>); RowGroup: 3 num_rows (i64).
_FILE_NUM_ROWS, _FILE_ROW_GROUPS, _GROUP_NUM_ROWS = 3, 4, 3


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int):
        if kind in (_TRUE, _FALSE):  # in a list a bool is one byte; as a field it is the type
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            self.pos += 8
            return self.data[self.pos - 8 : self.pos]
        if kind == _BINARY:
            n = self.varint()
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if kind in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if elem in (_TRUE, _FALSE):
                return elem, [self.byte() == 1 for _ in range(size)]
            return elem, [self.value(elem) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            if not size:
                return None, None, []
            types = self.byte()
            k, v = types >> 4, types & 0x0F
            return k, v, [(self.value(k), self.value(v)) for _ in range(size)]
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown compact type {kind}")

    def struct(self) -> list[list]:
        fields, last = [], 0
        while True:
            head = self.byte()
            if head == _STOP:
                return fields
            delta, kind = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            fields.append([fid, kind, self.value(kind)])
            last = fid


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            if n < 0x80:
                self.out.append(n)
                return
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, kind: int, v) -> None:
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.out.append(v)
        elif kind in (_I16, _I32, _I64):
            self.zigzag(v)
        elif kind == _DOUBLE:
            self.out += v
        elif kind == _BINARY:
            self.varint(len(v))
            self.out += v
        elif kind in (_LIST, _SET):
            elem, items = v
            if len(items) < 15:
                self.out.append(len(items) << 4 | elem)
            else:
                self.out.append(0xF0 | elem)
                self.varint(len(items))
            for item in items:
                if elem in (_TRUE, _FALSE):
                    self.out.append(1 if item else 0)
                else:
                    self.value(elem, item)
        elif kind == _MAP:
            k, vt, items = v
            self.varint(len(items))
            if items:
                self.out.append(k << 4 | vt)
                for a, b in items:
                    self.value(k, a)
                    self.value(vt, b)
        elif kind == _STRUCT:
            self.struct(v)

    def struct(self, fields: Iterable[list]) -> None:
        last = 0
        for fid, kind, v in fields:
            if kind in (_TRUE, _FALSE):
                kind = _TRUE if v else _FALSE
            if 0 < fid - last <= 15:
                self.out.append((fid - last) << 4 | kind)
            else:
                self.out.append(kind)
                self.zigzag(fid)
            self.value(kind, v)
            last = fid
        self.out.append(_STOP)


def _set(fields: list[list], fid: int, value: int) -> None:
    for field in fields:
        if field[0] == fid:
            field[2] = value
            return
    raise ValueError(f"no field {fid} in the footer struct")


def _get(fields: list[list], fid: int):
    return next(f[2] for f in fields if f[0] == fid)


def footer_counts(path: Path) -> tuple[int, list[int]]:
    """(the file's num_rows, each row group's num_rows) as its footer says."""
    data = Path(path).read_bytes()
    (length,) = struct.unpack("<I", data[-8:-4])
    meta = _Reader(data[-8 - length : -8]).struct()
    groups = _get(meta, _FILE_ROW_GROUPS)[1]
    return _get(meta, _FILE_NUM_ROWS), [_get(g, _GROUP_NUM_ROWS) for g in groups]


def forge_row_counts(
    path: Path, *, file_rows: int | None = None, group_rows: dict[int, int] | None = None
) -> Path:
    """Rewrite `path`'s footer in place: the file's num_rows to `file_rows`, row group g's
    num_rows to group_rows[g]; everything else as written."""
    data = Path(path).read_bytes()
    assert data[:4] == _MAGIC and data[-4:] == _MAGIC, f"{path} is not Parquet"
    (length,) = struct.unpack("<I", data[-8:-4])
    start = len(data) - 8 - length
    reader = _Reader(data[start:-8])
    meta = reader.struct()
    assert reader.pos == length, "footer not decoded to its end"
    if file_rows is not None:
        _set(meta, _FILE_NUM_ROWS, file_rows)
    groups = _get(meta, _FILE_ROW_GROUPS)[1]
    for g, rows in (group_rows or {}).items():
        _set(groups[g], _GROUP_NUM_ROWS, rows)
    writer = _Writer()
    writer.struct(meta)
    footer = bytes(writer.out)
    Path(path).write_bytes(data[:start] + footer + struct.pack("<I", len(footer)) + _MAGIC)
    return Path(path)


def write_forged_prompts(
    path: Path,
    rows: int = 8,
    *,
    file_rows: int | None = None,
    group_rows: dict[int, int] | None = None,
    row_group_size: int | None = None,
) -> Path:
    """`rows` real prompts (ids p0..), then the footer's counts changed as forge_row_counts."""
    table = pa.table(
        {"id": [f"p{i}" for i in range(rows)], "prompt": [f"a red circle {i}" for i in range(rows)]}
    )
    pq.write_table(table, path, row_group_size=row_group_size or rows)
    return forge_row_counts(path, file_rows=file_rows, group_rows=group_rows)
