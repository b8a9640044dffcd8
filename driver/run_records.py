"""Run records of an incremental job: which shards each run planned, over which input rows.

An incremental job's input grows (a new Parquet file lands every night) and each run adds
shards for the rows its output does not have yet. What a run planned is written once, before
any of its shards is dispatched, as `_runs/{run:05d}.json` (create-only: of two drivers planning
the same run number, one wins and the other plans again), next to the ids of its rows in
`_runs/{run:05d}-{token}.ids.parquet`. The records are the plan of the whole output:

- a shard keeps its number forever: a rerun or resume reads the same record and never renumbers;
  new shards are numbered after the highest shard any record holds;
- a shard of an earlier run that is not committed yet (its run crashed, or it failed) is run by
  the next run, as recorded, as long as its input file is unchanged;
- a shard whose file has changed or gone before it was committed cannot be made as planned: a
  later record lists it as `superseded`, and its rows are planned again from the current files
  (by id) if they are still there.

The ids files let a run skip rows whose id an earlier run already planned, reading one small
Parquet per run rather than every manifest.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ditfleet.workers.output.layout import RUNS_PREFIX, run_ids_key, run_key, run_of_key
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectNotFound, ObjectStore
from ditfleet.workers.storage.base import read_each
from ditfleet.workers.storage.parquet_bytes import read_parquet

RUN_RECORD_VERSION = 1
IDS_SCHEMA = pa.schema(
    [pa.field("shard", pa.int32(), nullable=False), pa.field("id", pa.string(), nullable=False)]
)


class RunRecordError(ValueError):
    """A run record that cannot be read; the message names it and says what to do."""


@dataclass(frozen=True)
class FileEntry:
    """An input file as a run saw it: its identity and the id prefix of its rows without ids."""

    uri: str
    size: int
    footer_sha256: str
    rows: int
    id_prefix: str

    def same_content(self, size: int, footer_sha256: str) -> bool:
        return self.size == size and self.footer_sha256 == footer_sha256


@dataclass(frozen=True)
class RunRecord:
    """What one run planned. shards: new shards of this run, over `files`; superseded: shards of
    earlier runs given up by this one (their files changed or went away before they committed)."""

    run: int
    created_at: str
    fingerprint: str  # the job's settings fingerprint (as in _job.json)
    files: tuple[FileEntry, ...]
    shards: tuple[ShardSpec, ...]
    superseded: tuple[int, ...] = ()
    ids_key: str | None = None  # the ids of the rows of `shards`; None when there are none
    skipped_rows: int = 0  # rows of `files` left out: their ids were in the output already

    @property
    def rows(self) -> int:
        return sum(s.num_rows for s in self.shards)

    @property
    def images(self) -> int:
        return sum(s.num_images for s in self.shards)

    def to_json(self) -> str:
        index = {f.uri: i for i, f in enumerate(self.files)}
        doc = {
            "version": RUN_RECORD_VERSION,
            "run": self.run,
            "created_at": self.created_at,
            "fingerprint": self.fingerprint,
            "files": [vars(f) for f in self.files],
            "shards": [
                {
                    "index": s.index,
                    "file": index[s.file],
                    "row_start": s.row_start,
                    "row_stop": s.row_stop,
                    "num_images": s.num_images,
                    "buckets_used": list(s.buckets_used),
                }
                for s in self.shards
            ],
            "superseded": list(self.superseded),
            "ids_key": self.ids_key,
            "rows": self.rows,
            "images": self.images,
            "skipped_rows": self.skipped_rows,
        }
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> RunRecord:
        try:
            doc = json.loads(text)
            if doc.get("version") != RUN_RECORD_VERSION:
                raise RunRecordError(
                    f"{where}: run record version {doc.get('version')!r}, this ditfleet reads "
                    f"{RUN_RECORD_VERSION}. Use the ditfleet version that made the output"
                )
            files = tuple(FileEntry(**f) for f in doc["files"])
            shards = tuple(
                ShardSpec(
                    index=int(s["index"]),
                    file=files[s["file"]].uri,
                    row_start=int(s["row_start"]),
                    row_stop=int(s["row_stop"]),
                    position_start=int(s["row_start"]),  # unused: rows without ids use id_prefix
                    buckets_used=tuple(s["buckets_used"]),
                    num_images=int(s["num_images"]),
                    id_prefix=files[s["file"]].id_prefix,
                )
                for s in doc["shards"]
            )
            return cls(
                run=int(doc["run"]),
                created_at=str(doc["created_at"]),
                fingerprint=str(doc["fingerprint"]),
                files=files,
                shards=shards,
                superseded=tuple(int(i) for i in doc.get("superseded") or ()),
                ids_key=doc.get("ids_key"),
                skipped_rows=int(doc.get("skipped_rows") or 0),
            )
        except RunRecordError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise RunRecordError(
                f"{where}: not a ditfleet run record ({type(e).__name__}: {e}). It was damaged or "
                "written by another tool; restore it, or start a new output"
            ) from e


def read_run_records(store: ObjectStore) -> list[RunRecord]:
    """Every run record of the output, by run number."""
    keys = sorted(k for k in store.list(RUNS_PREFIX) if run_of_key(k) is not None)

    def read(key: str) -> RunRecord:
        record = RunRecord.from_json(store.get(key), store.uri(key))
        if record.run != run_of_key(key):
            raise RunRecordError(f"{store.uri(key)} says it is run {record.run}; restore the file")
        return record

    return read_each(read, keys)


@dataclass(frozen=True)
class RecordedPlan:
    """The union of the run records: every shard, the run that planned it, and what is given up."""

    records: tuple[RunRecord, ...]
    shards: dict[int, ShardSpec]  # every shard ever planned, by index
    run_of: dict[int, int]  # shard index -> run
    superseded: frozenset[int]
    latest_file: dict[str, tuple[int, FileEntry]]  # uri -> (run, entry) of the latest run that read it

    @classmethod
    def of(cls, records: Sequence[RunRecord]) -> RecordedPlan:
        shards: dict[int, ShardSpec] = {}
        run_of: dict[int, int] = {}
        latest: dict[str, tuple[int, FileEntry]] = {}
        superseded: set[int] = set()
        for r in sorted(records, key=lambda r: r.run):
            for f in r.files:
                latest[f.uri] = (r.run, f)
            for s in r.shards:
                if s.index in shards:
                    raise RunRecordError(
                        f"shard {s.index} is in run {run_of[s.index]} and in run {r.run}: the run "
                        "records were edited. Restore them from a backup, or start a new output"
                    )
                shards[s.index] = s
                run_of[s.index] = r.run
            superseded.update(r.superseded)
        return cls(tuple(records), shards, run_of, frozenset(superseded), latest)

    @property
    def next_run(self) -> int:
        return max((r.run for r in self.records), default=0) + 1

    @property
    def next_shard(self) -> int:
        return max(self.shards, default=-1) + 1

    def live(self) -> list[ShardSpec]:
        """Shards that are to be (or were) made: every planned shard but the superseded ones."""
        return [s for i, s in sorted(self.shards.items()) if i not in self.superseded]

    def file_entry(self, shard: ShardSpec) -> FileEntry:
        record = next(r for r in self.records if r.run == self.run_of[shard.index])
        return next(f for f in record.files if f.uri == shard.file)


def write_ids(store: ObjectStore, run: int, token: str, shard_ids: Iterable[tuple[int, pa.Array]]) -> str:
    """Store the ids a run planned, (shard, id) per row; returns the key."""
    tables = [
        pa.table(
            {"shard": pa.array([shard] * len(ids), pa.int32()), "id": ids.cast(pa.string())},
            schema=IDS_SCHEMA,
        )
        for shard, ids in shard_ids
    ]
    table = pa.concat_tables(tables) if tables else IDS_SCHEMA.empty_table()
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    key = run_ids_key(run, token)
    store.put(key, buf.getvalue(), "application/vnd.apache.parquet")
    return key


def recorded_ids(store: ObjectStore, records: Sequence[RunRecord], leave_out: Iterable[int] = ()) -> pa.Array:
    """The ids of every row the records planned (a string array), but those of shards in
    `leave_out` (superseded ones: their rows are to be planned again)."""
    skip = pa.array(sorted(set(leave_out)), pa.int32())
    keys = [r.ids_key for r in records if r.ids_key]

    def read(key: str) -> pa.Array:
        try:
            table = read_parquet(store.get(key))
        except ObjectNotFound as e:
            raise RunRecordError(
                f"{store.uri(key)} is missing: a run record names it as the ids of its rows. "
                "Restore it, or start a new output"
            ) from e
        if len(skip):
            table = table.filter(pc.invert(pc.is_in(table.column("shard"), value_set=skip)))
        return table.column("id").combine_chunks()

    arrays = read_each(read, keys)
    return pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())


def claim_run(store: ObjectStore, record: RunRecord) -> bool:
    """Write the run record create-only. False: another driver planned this run number first."""
    return store.put_if_absent(run_key(record.run), record.to_json().encode(), "application/json")
