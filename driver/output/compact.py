"""`ditfleet compact OUT`: the union of a finished output's manifests as a few large Parquet files.

400,000 shard manifests are 400,000 footers for `pyarrow.dataset`, DuckDB or `datasets` to open.
After `_SUCCESS`, compaction writes the same rows, sorted by (id, k), as `compacted/part-NNNNN.parquet`
files of about `rows_per_file` rows each, in row groups of `row_group_rows`, which readers take in
one pass (`compacted/*.parquet`). The shard manifests stay the commit record: compaction reads
them, never changes them, and can be run again (it replaces the compacted set).

How, in bounded memory: split points of the id order come from a sample of the manifests; every
manifest is read once (in parallel) and its rows are spilled, by id range, into local temporary
files; then each range is sorted on its own and uploaded. `compacted/_index.json` is written last:
it lists the files, their rows and id ranges, and a digest of the union (sums of per-row 64-bit
digests over every column, so it does not depend on row order). `check_compacted` (run by
`ditfleet verify` when there is a compacted set) reads the files and the manifests again and says
whether the compacted set is exactly the union.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ditfleet.workers.output.layout import success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, current_manifest_keys, with_later_columns
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.value_digests import digests, mix

COMPACTED_PREFIX = "compacted/"
INDEX_KEY = COMPACTED_PREFIX + "_index.json"
COMPACT_VERSION = 1
ROWS_PER_FILE = 2_000_000
ROW_GROUP_ROWS = 131_072
_READ_THREADS = 16
_WINDOW = 256  # manifests read ahead at a time
_SAMPLE_SHARDS = 64
_SPILL_ROWS = 65_536
_SORT = [("id", "ascending"), ("k", "ascending")]


class CompactionError(RuntimeError):
    """The output cannot be compacted (not finished, or a manifest is unreadable)."""


def part_key(i: int) -> str:
    return f"{COMPACTED_PREFIX}part-{i:05d}.parquet"


@dataclass
class UnionDigest:
    """An order-free digest of a set of manifest rows: their count and two power sums of their
    per-row digests (mod 2^64)."""

    rows: int = 0
    sum1: int = 0
    sum2: int = 0

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        d = row_digests(table)
        self.rows += table.num_rows
        with np.errstate(over="ignore"):
            self.sum1 = (self.sum1 + int(d.sum(dtype=np.uint64))) % (1 << 64)
            self.sum2 = (self.sum2 + int((d * d).sum(dtype=np.uint64))) % (1 << 64)

    def to_dict(self) -> dict[str, object]:
        return {"rows": self.rows, "sum1": f"{self.sum1:016x}", "sum2": f"{self.sum2:016x}"}


def row_digests(table: pa.Table) -> np.ndarray:
    """One 64-bit digest per row over every manifest column (values as text, nulls as one
    constant): equal rows, equal digests, wherever they sit."""
    n = table.num_rows
    zeros = np.zeros(n, np.int64)
    h = np.full(n, np.uint64(len(MANIFEST_SCHEMA)), np.uint64)
    for name in MANIFEST_SCHEMA.names:
        column = table.column(name).combine_chunks()
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            column = column.cast(pa.string())
        with np.errstate(over="ignore"):
            h = mix(h * np.uint64(0x100000001B3) ^ digests(column, positions=zeros))
    return h


@dataclass
class CompactedFile:
    key: str
    rows: int
    min_id: str
    max_id: str
    bytes: int


@dataclass
class CompactionReport:
    output: str
    shards: int
    rows: int
    files: list[CompactedFile] = field(default_factory=list)
    union: UnionDigest = field(default_factory=UnionDigest)

    def to_dict(self) -> dict[str, object]:
        return {
            "version": COMPACT_VERSION,
            "output": self.output,
            "shards": self.shards,
            "rows": self.rows,
            "union": self.union.to_dict(),
            "files": [f.__dict__ for f in self.files],
        }

    def format_text(self) -> str:
        size = sum(f.bytes for f in self.files)
        return (
            f"compacted {self.output}: {self.rows} manifest rows of {self.shards} shards into "
            f"{len(self.files)} file(s) under {COMPACTED_PREFIX} ({size / 2**20:.1f} MiB), sorted by id"
        )


def _read(store: ObjectStore, key: str) -> pa.Table:
    try:
        table = with_later_columns(pq.read_table(io.BytesIO(store.get(key))))
    except (OSError, pa.ArrowException) as e:
        raise CompactionError(f"{store.uri(key)}: cannot read this manifest ({e})") from e
    if not table.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
        raise CompactionError(f"{store.uri(key)} does not have the manifest schema")
    return table.replace_schema_metadata(None)


def iter_manifests(
    store: ObjectStore, keys: Sequence[str], threads: int = _READ_THREADS, batch_rows: int = 0
) -> Iterator[pa.Table]:
    """The manifests at `keys`, read `threads` at a time, in order, a window ahead at most;
    with batch_rows, several manifests at a time as one table of at least that many rows (the
    per-table work, digests and range splits, then runs once per batch, not once per manifest)."""
    held: list[pa.Table] = []
    rows = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for at in range(0, len(keys), _WINDOW):
            for table in pool.map(lambda k: _read(store, k), keys[at : at + _WINDOW]):
                if not batch_rows:
                    yield table
                    continue
                held.append(table)
                rows += table.num_rows
                if rows >= batch_rows:
                    yield pa.concat_tables(held).combine_chunks()
                    held, rows = [], 0
    if held:
        yield pa.concat_tables(held).combine_chunks()


def _split_points(store: ObjectStore, keys: Sequence[str], rows_per_file: int, threads: int) -> list[str]:
    """Ids that cut the id order into ranges of about rows_per_file rows, from a sample of
    evenly spaced manifests."""
    step = max(1, len(keys) // _SAMPLE_SHARDS)
    sample = list(keys[::step])
    tables = list(iter_manifests(store, sample, threads))
    ids = (
        pa.concat_arrays([t.column("id").combine_chunks() for t in tables])
        if tables
        else pa.array([], pa.string())
    )
    if not len(ids):
        return []
    estimate = len(ids) / len(sample) * len(keys)
    parts = max(1, round(estimate / rows_per_file))
    if parts == 1:
        return []
    ordered = pc.sort_indices(ids)
    cuts = {ids[ordered[int(len(ids) * i / parts)].as_py()].as_py() for i in range(1, parts)}
    return sorted(cuts)


def _range_of(ids: pa.Array, cuts: Sequence[str]) -> np.ndarray:
    """Per id, the index of its range: how many cuts are <= it."""
    out = np.zeros(len(ids), np.int32)
    for cut in cuts:
        out += np.asarray(pc.greater_equal(ids, cut).to_numpy(zero_copy_only=False), np.int32)
    return out


def compact_output(
    store: ObjectStore,
    rows_per_file: int = ROWS_PER_FILE,
    row_group_rows: int = ROW_GROUP_ROWS,
    threads: int = _READ_THREADS,
    temp_dir: str | None = None,
) -> CompactionReport:
    """Compact a finished output's manifests (see the module docstring). Raises CompactionError."""
    if not store.exists(success_key()):
        raise CompactionError(
            f"{store.uri()}: no _SUCCESS yet. Compact a finished output: the manifests are still changing"
        )
    current = current_manifest_keys(store)
    keys = [current[s] for s in sorted(current)]
    cuts = _split_points(store, keys, rows_per_file, threads)
    report = CompactionReport(store.uri(), len(keys), 0)
    schema = MANIFEST_SCHEMA.remove_metadata()
    with tempfile.TemporaryDirectory(prefix="ditfleet-compact-", dir=temp_dir) as tmp:
        spills = [os.path.join(tmp, f"range-{i:05d}.parquet") for i in range(len(cuts) + 1)]
        writers = [pq.ParquetWriter(p, schema, compression="lz4") for p in spills]
        try:
            for table in iter_manifests(store, keys, threads, batch_rows=_SPILL_ROWS):
                report.union.add(table)
                ranges = _range_of(table.column("id").combine_chunks(), cuts) if cuts else None
                for i in range(len(spills)):
                    part = table if ranges is None else table.filter(pa.array(ranges == i))
                    if part.num_rows:
                        writers[i].write_table(part)
        finally:
            for w in writers:
                w.close()
        report.rows = report.union.rows
        # Earlier compacted files that this run does not overwrite would be read with the new set.
        stale = [k for k in store.list(COMPACTED_PREFIX) if k != INDEX_KEY]
        if store.exists(INDEX_KEY):
            store.delete(INDEX_KEY)  # the set is incomplete until the new index is written
        written = 0
        for spill in spills:
            table = pq.read_table(spill).sort_by(_SORT)
            os.remove(spill)
            if not table.num_rows:
                continue
            key = part_key(written)
            local = os.path.join(tmp, "part.parquet")
            pq.write_table(
                table.replace_schema_metadata(MANIFEST_SCHEMA.metadata),
                local,
                row_group_size=row_group_rows,
                compression="zstd",
            )
            with open(local, "rb") as f:
                store.put_file(key, f, "application/vnd.apache.parquet")
            ids = table.column("id")
            report.files.append(
                CompactedFile(key, table.num_rows, ids[0].as_py(), ids[-1].as_py(), os.path.getsize(local))
            )
            os.remove(local)
            written += 1
    for key in stale:
        if key not in {f.key for f in report.files}:
            store.delete(key)
    store.put(INDEX_KEY, json.dumps(report.to_dict(), indent=2).encode(), "application/json")
    return report


def check_compacted(store: ObjectStore, threads: int = _READ_THREADS) -> list[str]:
    """Problems of the compacted set (none when there is no `compacted/`): every file its index
    lists present with the manifest schema and its rows, ids in order within and across files,
    nothing else under compacted/, and the rows exactly the union of the shard manifests."""
    keys = list(store.list(COMPACTED_PREFIX))
    if not keys:
        return []
    where = store.uri(INDEX_KEY)
    if INDEX_KEY not in keys:
        return [f"{where}: missing: {COMPACTED_PREFIX} holds files but no index (compaction did not finish; run `ditfleet compact` again)"]  # fmt: skip
    try:
        index = json.loads(store.get(INDEX_KEY))
        listed = [CompactedFile(**f) for f in index["files"]]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{where}: unreadable index ({e})"]
    problems = [
        f"{store.uri(k)}: stray object in {COMPACTED_PREFIX} (not in its index)"
        for k in keys
        if k != INDEX_KEY and k not in {f.key for f in listed}
    ]
    compacted = UnionDigest()
    last_id: str | None = None
    for f in listed:
        if f.key not in keys:
            problems.append(f"{store.uri(f.key)}: missing (listed in {where})")
            continue
        try:
            table = with_later_columns(pq.read_table(io.BytesIO(store.get(f.key))))
        except (OSError, pa.ArrowException) as e:
            problems.append(f"{store.uri(f.key)}: unreadable ({e})")
            continue
        if not table.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
            problems.append(f"{store.uri(f.key)}: not the manifest schema")
            continue
        if table.num_rows != f.rows:
            problems.append(f"{store.uri(f.key)}: {table.num_rows} rows, its index says {f.rows}")
        ids = table.column("id").combine_chunks()
        if len(ids) and (
            (last_id is not None and ids[0].as_py() < last_id)
            or not pc.all(pc.less_equal(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py()
        ):
            problems.append(f"{store.uri(f.key)}: ids not in order")
        if len(ids):
            last_id = ids[-1].as_py()
        compacted.add(table)
    current = current_manifest_keys(store)
    union = UnionDigest()
    try:
        for table in iter_manifests(store, [current[s] for s in sorted(current)], threads, _SPILL_ROWS):
            union.add(table)
    except CompactionError as e:
        return [*problems, f"cannot compare the compacted set with the manifests: {e}"]
    if compacted.to_dict() != union.to_dict():
        problems.append(
            f"{store.uri().rstrip('/')}/{COMPACTED_PREFIX}: not the union of the shard manifests ({compacted.rows} rows "
            f"vs {union.rows} in {len(current)} manifests, or other values); run `ditfleet compact` again"
        )
    return problems
