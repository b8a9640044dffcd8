"""`ditfleet compact OUT`: the union of a finished output's current manifests as one Parquet file.

400,000 shard manifests are 400,000 footers for `pyarrow.dataset`, DuckDB or `datasets` to open.
Compaction writes the same rows, sorted by (id, k), as `compacted/manifests.parquet`, in row
groups of `row_group_rows`, which readers take in one pass (`compacted/manifests.parquet`, or
`compacted/*.parquet`). The shard manifests stay the commit record: compaction reads them and
never changes them.

The set is one object on purpose: a single whole-object write (a local rename, an S3 PUT or
completed multipart upload) replaces it atomically, so a compaction killed at any point leaves
the old set or the new one, never a mix of both. `compacted/_index.json`, written after it, says
what it was made from: the rows, a sha256 digest of them (`UnionDigest`), and `made_from`, the (shard,
generation) of every current manifest. A redo changes a shard's current generation, so the set
is then *stale*, which `compacted_state` tells from the listing alone (status, verify, the
driver's finish, which rebuilds it). A compaction killed between its file and its index leaves
an index of an older set: at worst the set reads as stale and is rebuilt, never as current when
it is not, since a compaction always reads the newest manifests.

How, in bounded memory: split points of the id order come from a sample of the manifests; every
manifest is read once (in parallel) and its rows are spilled, by id range, into local temporary
files; each range is then sorted on its own and appended, in order, to the one output file.
Compaction is a writer like a driver: it runs under the output's lease.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ditfleet.driver.output.json_objects import read_json
from ditfleet.driver.output.lease import (
    OutputLease,
    holder_is_gone,
    lease_generations,
    read_lease_document,
    this_process,
)
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.driver.output.success import success_file
from ditfleet.workers.output.layout import manifest_of_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, current_manifest_keys, with_later_columns
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import READ_THREADS
from ditfleet.workers.storage.parquet_bytes import read_parquet

COMPACTED_PREFIX = "compacted/"
COMPACTED_KEY = COMPACTED_PREFIX + "manifests.parquet"
INDEX_KEY = COMPACTED_PREFIX + "_index.json"
# 3: the digest is sha256 (UnionDigest); an index of version 2 reads as missing: rebuilt.
COMPACT_VERSION = 3
ROW_GROUP_ROWS = 131_072
# Rows sorted in memory at once (one id range); bounds compaction's memory, not the file's size.
RANGE_ROWS = 2_000_000
_WINDOW = 256  # manifests read ahead at a time
_SAMPLE_SHARDS = 64
_SPILL_ROWS = 65_536
_SORT = [("id", "ascending"), ("k", "ascending")]
SPILL_PREFIX = "ditfleet-compact-"
_OWNER = "owner.json"


class CompactionError(RuntimeError):
    """The output cannot be compacted (not finished, or a manifest is unreadable)."""


@dataclass
class UnionDigest:
    """A digest of a set of manifest rows that does not depend on how they are split into files
    or ordered across shards, and that nobody can match without the same rows: sha256 over every
    shard's digest in shard order, where a shard's digest is sha256 over its rows in (id, k)
    order, each row encoded without ambiguity (`row_texts`).

    `add` takes tables in any grouping, provided every shard's rows come in (id, k) order across
    calls: a shard manifest (sorted here, stably) or the compacted set's row groups in file order
    (sorted by (id, k) already). Memory: one running sha256 per shard (about 200 bytes each).
    """

    rows: int = 0
    shards: dict[int, Any] = field(default_factory=dict)

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        self.rows += table.num_rows
        # Stable: rows of one shard keep their (id, k) order, ties in the order they came.
        order = pc.sort_indices(table, [("shard", "ascending"), *_SORT])
        shard = table.column("shard").combine_chunks().take(order).to_numpy(zero_copy_only=False)
        texts = row_texts(table).take(order)
        offsets = np.frombuffer(texts.buffers()[1], np.int64)[texts.offset : texts.offset + len(texts) + 1]
        data = memoryview(texts.buffers()[2] or b"")
        cuts = [0, *(np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist(), len(shard)]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            s = int(shard[lo])
            if s not in self.shards:
                self.shards[s] = hashlib.sha256()
            self.shards[s].update(data[int(offsets[lo]) : int(offsets[hi])])

    def sha256(self) -> str:
        whole = hashlib.sha256()
        for s in sorted(self.shards):
            whole.update(f"{s}:{self.shards[s].hexdigest()}\n".encode())
        return whole.hexdigest()

    def to_dict(self) -> dict[str, object]:
        return {"rows": self.rows, "sha256": self.sha256()}


_COLON, _EMPTY, _NULL = (pa.scalar(v, pa.large_string()) for v in (":", "", "-"))


def row_texts(table: pa.Table) -> pa.Array:
    """Each row of `table` as one string over every manifest column, in schema order: a null as
    "-", a value as its UTF-8 length in bytes, ":", and its text (numbers in decimal; a list as
    its elements' texts, each written the same way, one after another), so that no two different
    rows give the same string and rows can be concatenated without a separator."""
    parts = [_value_texts(table.column(name).combine_chunks()) for name in MANIFEST_SCHEMA.names]
    return pc.binary_join_element_wise(*parts, _EMPTY)


def _value_texts(column: pa.Array) -> pa.Array:
    """Each value of `column` as "-" (null) or "<UTF-8 length>:<text>", as large strings."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = _list_texts(column)
    elif not pa.types.is_large_string(column.type):
        column = column.cast(pa.large_string())
    length = pc.binary_length(column).cast(pa.large_string())
    return pc.coalesce(pc.binary_join_element_wise(length, _COLON, column, _EMPTY), _NULL)


def _list_texts(column: pa.Array) -> pa.Array:
    """Each list of `column` as its elements' `_value_texts` concatenated; a null list stays null
    (an empty list is ""). The element texts delimit themselves, so the list is recovered whole:
    ["ab", "c"] and ["a", "bc"] differ, and so do [] and [""] and [null]."""
    elements = _value_texts(pc.list_flatten(column))  # null lists have no elements here
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), pa.int64())
    lists = pa.LargeListArray.from_arrays(offsets, elements, mask=column.is_null())
    return pc.binary_join(lists, _EMPTY)


def made_from(current: Mapping[int, str]) -> dict[str, Any]:
    """What a compacted set is made of, from the current manifest keys (shard -> key): how many
    shards, a digest of every (shard, generation), and the shards at a redo generation (few)."""
    generations = {s: manifest_of_key(k)[1] for s, k in current.items()}  # type: ignore[index]
    text = "".join(f"{s}:{g}\n" for s, g in sorted(generations.items()))
    return {
        "shards": len(generations),
        "generations_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "redone": {str(s): g for s, g in sorted(generations.items()) if g},
    }


@dataclass
class CompactionReport:
    output: str
    shards: int
    rows: int = 0
    bytes: int = 0
    union: UnionDigest = field(default_factory=UnionDigest)
    made_from: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "version": COMPACT_VERSION,
            "file": COMPACTED_KEY,
            "output": self.output,
            "shards": self.shards,
            "rows": self.rows,
            "bytes": self.bytes,
            "union": self.union.to_dict(),
            "made_from": self.made_from,
        }

    def format_text(self) -> str:
        return (
            f"compacted {self.output}: {self.rows} manifest rows of {self.shards} shards into "
            f"{COMPACTED_KEY} ({self.bytes / 2**20:.1f} MiB), sorted by id"
        )


@dataclass(frozen=True)
class CompactedState:
    """Whether an output has a compacted set and whether it is the union of today's manifests.
    `why` says what is wrong, in one line, when it is not current."""

    present: bool
    current: bool
    why: str = ""

    def describe(self) -> str:
        if not self.present:
            return "none"
        return "current" if self.current else f"STALE: {self.why}; run `ditfleet compact` again"


def compacted_state(store: ObjectStore, current: Mapping[int, str] | None = None) -> CompactedState:
    """The compacted set's state from listings and its index (no manifest or data is read)."""
    keys = set(store.list(COMPACTED_PREFIX))
    if not keys:
        return CompactedState(False, False)
    if COMPACTED_KEY not in keys:
        return CompactedState(True, False, f"{COMPACTED_PREFIX} has no {COMPACTED_KEY.split('/')[-1]}")
    try:
        index = read_json(store, INDEX_KEY)
    except ValueError:
        index = None
    if (
        isinstance(index, dict)
        and isinstance(index.get("version"), int)
        and index["version"] < COMPACT_VERSION
    ):
        return CompactedState(
            True, False, f"{store.uri(INDEX_KEY)} is of an earlier version (its digest is not sha256)"
        )
    if not isinstance(index, dict) or index.get("version") != COMPACT_VERSION:
        return CompactedState(True, False, f"{store.uri(INDEX_KEY)} is missing or unreadable")
    then = index.get("made_from") or {}
    now = made_from(current if current is not None else current_manifest_keys(store))
    if then.get("generations_sha256") == now["generations_sha256"]:
        return CompactedState(True, True)
    redone = sorted(
        int(s)
        for s in set(now["redone"]) | set(then.get("redone", {}))
        if now["redone"].get(s) != then.get("redone", {}).get(s)
    )
    if redone:
        why = f"made before shards {redone[:20]}{' ...' if len(redone) > 20 else ''} were redone"
    else:
        why = f"made from {then.get('shards')} shard manifests, the output has {now['shards']} now"
    return CompactedState(True, False, why)


def _read(store: ObjectStore, key: str) -> pa.Table:
    try:
        table = with_later_columns(read_parquet(store.get(key)))
    except (OSError, pa.ArrowException) as e:
        raise CompactionError(f"{store.uri(key)}: cannot read this manifest ({e})") from e
    if not table.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
        raise CompactionError(f"{store.uri(key)} does not have the manifest schema")
    return table.replace_schema_metadata(None)


def iter_manifests(store: ObjectStore, keys: Sequence[str]) -> Iterator[pa.Table]:
    """The manifests at `keys`, read READ_THREADS at a time, in order, a window ahead at most, as
    tables of at least _SPILL_ROWS rows (the per-table work, digests and range splits, then runs
    once per batch, not once per manifest)."""
    held: list[pa.Table] = []
    rows = 0
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        for at in range(0, len(keys), _WINDOW):
            for table in pool.map(lambda k: _read(store, k), keys[at : at + _WINDOW]):
                held.append(table)
                rows += table.num_rows
                if rows >= _SPILL_ROWS:
                    yield pa.concat_tables(held).combine_chunks()
                    held, rows = [], 0
    if held:
        yield pa.concat_tables(held).combine_chunks()


def _split_points(store: ObjectStore, keys: Sequence[str], range_rows: int) -> list[str]:
    """Ids that cut the id order into ranges of about range_rows rows, from a sample of
    evenly spaced manifests."""
    sample = list(keys[:: max(1, len(keys) // _SAMPLE_SHARDS)])
    ids = pa.chunked_array(
        [t.column("id").combine_chunks() for t in iter_manifests(store, sample)], pa.string()
    )
    if not len(ids):
        return []
    estimate = len(ids) / len(sample) * len(keys)
    parts = max(1, round(estimate / range_rows))
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
    row_group_rows: int = ROW_GROUP_ROWS,
    *,
    lease: OutputLease | None = None,
    finished: bool = False,
    range_rows: int = RANGE_ROWS,
) -> CompactionReport:
    """Compact an output's current manifests (see the module docstring). Raises CompactionError.

    lease: the lease of the driver or of `ditfleet compact` this runs under; checked before the
    set and its index are written (OutputBusy when another took the output). finished: the
    caller, a driver at its finish, knows every shard is committed (its `_SUCCESS` comes after);
    otherwise the output must have a valid `_SUCCESS` (driver.output.success).
    """
    if not finished and success_file(store, lease.generation if lease else None).doc is None:
        raise CompactionError(
            f"{store.uri()}: no valid _SUCCESS. Compact a finished output: the manifests are still changing"
        )
    # The fence: the versions of the set and its index before the view is read. They are written
    # only over these versions, so a writer that made a set from a newer view in between (a redo's
    # finish) wins, and this one, paused however long, writes nothing.
    set_was, index_was = store.version(COMPACTED_KEY), store.version(INDEX_KEY)
    current = current_manifest_keys(store)
    keys = [current[s] for s in sorted(current)]
    cuts = _split_points(store, keys, range_rows)
    report = CompactionReport(store.uri(), len(keys), made_from=made_from(current))
    with spill_directory() as tmp:
        spills = _spill_by_id_range(store, keys, cuts, tmp, report.union)
        report.rows = report.union.rows
        local = os.path.join(tmp, "manifests.parquet")
        _write_sorted(spills, local, row_group_rows)
        report.bytes = os.path.getsize(local)
        pause_point("compact_before_write")
        if lease is not None:
            lease.check()
        pause_point("compact_after_lease_check")
        # Files of the earlier layout (compacted/part-NNNNN.parquet) would be read with the new
        # set: the old set goes first, so a kill in between leaves too little, never a mix.
        for key in _strays(store):
            store.delete(key)
        with open(local, "rb") as f:
            if not store.put_file_if(COMPACTED_KEY, f, set_was, "application/vnd.apache.parquet"):
                raise _overtaken(store, COMPACTED_KEY)
    pause_point("compact_before_index")
    index = (json.dumps(report.to_dict(), indent=2) + "\n").encode()
    if not store.put_file_if(INDEX_KEY, io.BytesIO(index), index_was, "application/json"):
        raise _overtaken(store, INDEX_KEY)
    return report


def _overtaken(store: ObjectStore, key: str) -> CompactionError:
    return CompactionError(
        f"{store.uri(key)} was written by another writer while this compaction ran (a driver that "
        "took the output, e.g. a redo, rebuilt the set from newer manifests): this compaction's "
        "set, made from the manifests it read before, is not written. Run `ditfleet status`; "
        "compact again if it says the compacted set is stale"
    )


@contextlib.contextmanager
def spill_directory() -> Iterator[str]:
    """A local temporary directory for compaction's spill files (a full copy of the manifests),
    removed at the end. It records its owner (pid, process space), so that the next compaction
    on this machine removes those of killed ones first (`remove_abandoned_spills`)."""
    remove_abandoned_spills()
    tmp = tempfile.mkdtemp(prefix=SPILL_PREFIX)
    try:
        with open(os.path.join(tmp, _OWNER), "w") as f:
            json.dump(this_process(), f)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_abandoned_spills(folder: str | None = None) -> list[str]:
    """Remove the spill directories of compactions whose process is gone (killed: no `finally`
    ran), in `folder` (the temporary folder); returns them. Only provably abandoned ones go: the
    owner recorded, in this process space, and exited. One without an owner file (killed within
    microseconds of its creation) or of another machine or container is left."""
    folder = folder or tempfile.gettempdir()
    removed = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.startswith(SPILL_PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and holder_is_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _spill_by_id_range(
    store: ObjectStore, keys: Sequence[str], cuts: Sequence[str], tmp: str, union: UnionDigest
) -> list[str]:
    """Every manifest at `keys` read once, its rows added to `union` and written, unsorted, to the
    local file of their id range (one per range between `cuts`, in `tmp`); the files, in id order."""
    spills = [os.path.join(tmp, f"range-{i:05d}.parquet") for i in range(len(cuts) + 1)]
    writers = [pq.ParquetWriter(p, MANIFEST_SCHEMA.remove_metadata(), compression="lz4") for p in spills]
    try:
        for table in iter_manifests(store, keys):
            union.add(table)
            ranges = _range_of(table.column("id").combine_chunks(), cuts) if cuts else None
            for i, writer in enumerate(writers):
                part = table if ranges is None else table.filter(pa.array(ranges == i))
                if part.num_rows:
                    writer.write_table(part)
    finally:
        for w in writers:
            w.close()
    return spills


def _write_sorted(spills: Sequence[str], path: str, row_group_rows: int) -> None:
    """Each range file sorted by (id, k) on its own and appended, in order, to the set at `path`."""
    with pq.ParquetWriter(path, MANIFEST_SCHEMA, compression="zstd") as out:
        for spill in spills:
            table = pq.read_table(spill).sort_by(_SORT)
            os.remove(spill)
            if table.num_rows:
                out.write_table(table.replace_schema_metadata(MANIFEST_SCHEMA.metadata), row_group_rows)


def _strays(store: ObjectStore) -> list[str]:
    """The keys under compacted/ other than the set and its index."""
    return [k for k in store.list(COMPACTED_PREFIX) if k not in (COMPACTED_KEY, INDEX_KEY)]


def refresh_compacted(store: ObjectStore, lease: OutputLease | None) -> CompactionReport | None:
    """At a driver's finish (every shard committed): rebuild an existing compacted set that is not
    the union of the current manifests (a redo changed a generation), and build one where none is
    but a `ditfleet compact` that this driver took the output from never released it: that one may
    be paused with a set of older manifests in hand, and writes it only while the set is as it
    found it (absent), which this build ends. None when nothing was built. A run that never
    compacted is not made to: only a set the user asked for is kept current."""
    state = compacted_state(store)
    if state.present and state.current:
        return None
    if not state.present and not _unreleased_compaction(store, lease):
        return None
    return compact_output(store, lease=lease, finished=True)


def _unreleased_compaction(store: ObjectStore, lease: OutputLease | None) -> bool:
    """Whether a lease document below `lease` (all, without one) is a compaction's, not released."""
    below = [g for g in lease_generations(store) if lease is None or g < lease.generation]
    for generation in below:
        doc = read_lease_document(store, generation)
        if doc is not None and doc.get("compacts") and not doc.get("released"):
            return True
    return False


def check_compacted(store: ObjectStore) -> list[str]:
    """Problems of the compacted set (none when there is no `compacted/`): it is there with its
    index, made from today's manifest generations, has the manifest schema and the index's rows,
    ids in order, nothing else under compacted/, and its rows are exactly the union of the
    current shard manifests."""
    current = current_manifest_keys(store)
    state = compacted_state(store, current)
    if not state.present:
        return []
    if not state.current:
        return [f"{store.uri().rstrip('/')}/{COMPACTED_PREFIX}: {state.describe()}"]
    index = read_json(store, INDEX_KEY) or {}
    problems = [
        f"{store.uri(k)}: stray object in {COMPACTED_PREFIX} (compaction writes only {COMPACTED_KEY})"
        for k in _strays(store)
    ]
    try:
        compacted, in_order = _read_compacted(store)
    except CompactionError as e:
        return [*problems, str(e)]
    if compacted.rows != index.get("rows"):
        problems.append(
            f"{store.uri(COMPACTED_KEY)}: {compacted.rows} rows, its index says {index.get('rows')}"
        )
    if not in_order:
        problems.append(f"{store.uri(COMPACTED_KEY)}: ids not in order")
    union = UnionDigest()
    try:
        for part in iter_manifests(store, [current[s] for s in sorted(current)]):
            union.add(part)
    except CompactionError as e:
        return [*problems, f"cannot compare the compacted set with the manifests: {e}"]
    if compacted.to_dict() != union.to_dict():
        problems.append(
            f"{store.uri(COMPACTED_KEY)}: not the union of the shard manifests ({compacted.rows} rows "
            f"vs {union.rows} in {len(current)} manifests, or other values); run `ditfleet compact` again"
        )
    return problems


def _read_compacted(store: ObjectStore) -> tuple[UnionDigest, bool]:
    """The compacted set's digest and whether its ids are in order, read row group by row group
    (it can be far larger than memory). CompactionError: unreadable, or not the manifest schema."""
    digest, in_order, last_id = UnionDigest(), True, ""
    with spill_directory() as tmp, open(os.path.join(tmp, "compacted.parquet"), "w+b") as f:
        try:
            store.get_file(COMPACTED_KEY, f)
            f.flush()
            # By path: Arrow then owns the buffers it reads (see workers.storage.parquet_bytes).
            parquet = pq.ParquetFile(f.name)
            empty = with_later_columns(parquet.schema_arrow.empty_table())
            if not empty.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
                raise CompactionError(f"{store.uri(COMPACTED_KEY)}: not the manifest schema")
            for group in range(parquet.num_row_groups):
                table = with_later_columns(parquet.read_row_group(group))
                ids = table.column("id").combine_chunks()
                if len(ids):
                    in_order &= ids[0].as_py() >= last_id
                    in_order &= len(ids) < 2 or pc.all(pc.less_equal(ids[:-1], ids[1:])).as_py()
                    last_id = ids[-1].as_py()
                digest.add(table)
        except (OSError, pa.ArrowException) as e:
            raise CompactionError(f"{store.uri(COMPACTED_KEY)}: unreadable ({e})") from e
    return digest, in_order
