"""Planning one run of an incremental job: only the rows that its output does not have yet.

An incremental job (`input.incremental: true`) reads a directory or prefix that grows. A run:

1. lists the input files and identifies each by size and footer hash (one small read per file);
2. reads the output's run records (driver.run_records): the shards every earlier run planned;
3. carries over the earlier shards that are not committed yet (a crashed or failed run), with
   their numbers, if their file is unchanged; gives up (supersedes) those whose file changed or
   went away, so that their rows are planned again from the files as they are now;
4. validates and plans only the files that no record has seen as they are now, leaving out
   every row whose id an earlier run planned (rows without an id column are keyed by file name
   and row: "2024-06-01.parquet#17"), and numbers the new shards after the highest recorded one.

With nothing new, steps 1-3 are all it does: no file is scanned and nothing is written. Memory:
the ids of earlier runs are read only when there are new files (one string per planned row).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.input.arrays import plain
from ditfleet.driver.input.prompts import InputFile, PromptSource
from ditfleet.driver.input.scan import ScanOptions, scan_input
from ditfleet.driver.output.lease import OutputLease, shard_ranges
from ditfleet.driver.output.success import remove_success
from ditfleet.driver.plan import PlanConfig, ShardCutter, footer_hashes, row_group_warnings
from ditfleet.driver.run_records import (
    FileEntry,
    RecordedPlan,
    RunRecord,
    claim_run,
    read_run_records,
    recorded_ids,
    write_ids,
)
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.sources import SourceReader
from ditfleet.workers.storage import ObjectStore, S3Config

ID_SEPARATOR = "#"  # between a file's name and the row, in the id of a row without an id column


@dataclass(frozen=True)
class IncrementPlan:
    """What one incremental run does: carried-over shards of earlier runs, and its own new ones.

    record is None when nothing is new (no file to read, nothing to give up): nothing is written.
    """

    fingerprint: str
    recorded: RecordedPlan
    files: int  # input files now
    carried: tuple[ShardSpec, ...]  # not committed yet, planned by earlier runs
    record: RunRecord | None
    ids: tuple[tuple[int, pa.Array], ...] = field(default=(), repr=False)  # (shard, ids) of new shards
    token: str = ""
    warnings: tuple[str, ...] = ()  # about the new files: nothing wrong, but slow

    @property
    def new_shards(self) -> tuple[ShardSpec, ...]:
        return self.record.shards if self.record is not None else ()

    @property
    def todo(self) -> list[ShardSpec]:
        return sorted((*self.carried, *self.new_shards), key=lambda s: s.index)

    def describe(self) -> list[str]:
        """Lines for the log: what this run found and will do."""
        lines = []
        r = self.record
        if r is not None:
            new = [f for f in r.files if f.rows]
            line = f"run {r.run}: {len(r.files)} new or changed input file(s)"
            if r.shards:
                first, last = r.shards[0].index, r.shards[-1].index
                line += f", {r.rows} new rows ({r.images} images) in shards {first:05d}-{last:05d}"
            else:
                line += ", no new rows"
            if r.skipped_rows:
                line += f"; {r.skipped_rows} rows left out (their ids are in the output already)"
            lines.append(line)
            if len(new) < len(r.files):
                lines.append(f"  {len(r.files) - len(new)} of them empty")
            if r.superseded:
                lines.append(
                    f"  {len(r.superseded)} uncommitted shard(s) of earlier runs given up: their input "
                    "file changed or is gone (their rows were planned again where still present)"
                )
        if self.carried:
            lines.append(f"{len(self.carried)} shard(s) of earlier runs not committed yet: running them now")
        lines += [f"warning: {w}" for w in self.warnings]
        return lines


class _NewRowSelector:
    """Sees every batch of the new files (through scan_input) and passes on to the shard cutter
    only the rows whose id is not covered yet, in contiguous runs; keeps the ids it passed on."""

    def __init__(self, cutter: ShardCutter, covered: pa.Array, prefixes: Mapping[str, str]) -> None:
        self.cutter = cutter
        self.covered = covered
        self.prefixes = prefixes
        self.ids: dict[str, list[pa.Array]] = {}  # file uri -> ids of the rows passed on, in row order
        self.skipped: dict[str, int] = {}

    def ids_of(self, file: InputFile, first_row: int, batch: pa.RecordBatch) -> pa.Array:
        """The id of each row as the worker resolves it (workers.rows.resolve_rows)."""
        if "id" in batch.schema.names:
            return plain(batch.column("id")).cast(pa.string())  # integers in decimal
        prefix = self.prefixes[file.uri]
        return pa.array([f"{prefix}{first_row + i}" for i in range(batch.num_rows)], pa.string())

    def on_batch(self, file: InputFile, first_row: int, first_position: int, batch: pa.RecordBatch) -> None:
        ids = self.ids_of(file, first_row, batch)
        if len(self.covered):
            new = pc.invert(pc.fill_null(pc.is_in(ids, value_set=self.covered), False))
            count = pc.sum(new).as_py() or 0
        else:
            new, count = None, batch.num_rows
        self.skipped[file.uri] = self.skipped.get(file.uri, 0) + batch.num_rows - count
        if count == batch.num_rows:
            spans = [(0, batch.num_rows)]
        elif count == 0:
            spans = []
        else:
            spans = [(a, b + 1) for a, b in shard_ranges(pc.indices_nonzero(new).to_pylist())]
        for start, stop in spans:
            self.cutter.on_batch(
                file, first_row + start, first_position + start, batch.slice(start, stop - start)
            )
            self.ids.setdefault(file.uri, []).append(ids.slice(start, stop - start))

    def shard_ids(self, shards: Sequence[ShardSpec]) -> tuple[tuple[int, pa.Array], ...]:
        """(shard, ids of its rows) for each of `shards`, cut from the ids passed on."""
        out: list[tuple[int, pa.Array]] = []
        for uri, chunks in self.ids.items():
            ids = pa.concat_arrays(chunks)
            at = 0
            for shard in (s for s in shards if s.file == uri):
                out.append((shard.index, ids.slice(at, shard.num_rows)))
                at += shard.num_rows
        return tuple(out)


def plan_increment(
    source: PromptSource,
    config: PlanConfig,
    store: ObjectStore,
    committed: set[int],
    fingerprint: str,
    created_at: str | None = None,
    s3: S3Config | None = None,
) -> IncrementPlan:
    """Plan the next run of an incremental job over `source` into `store` (read only: the caller
    writes the record with `commit_increment`). committed: the shards with a manifest. s3: the
    job's S3 settings, for an edit job's sources on S3.

    Raises InputError for bad rows in the new files (earlier files are not read again),
    RunRecordError for damaged records.
    """
    files = source.files()
    sha = footer_hashes(source, files)
    recorded = RecordedPlan.of(read_run_records(store))
    carried, superseded_now = _carry_over(recorded, committed, {f.uri: (f.size, sha[f.uri]) for f in files})
    gone = recorded.superseded | set(superseded_now)
    new_files = _files_to_read(files, sha, recorded, gone)
    if not new_files and not superseded_now:
        return IncrementPlan(fingerprint, recorded, len(files), tuple(carried), None)

    rows: dict[str, int] = {}
    for f in new_files:
        with source.open(f) as pf:
            rows[f.uri] = pf.metadata.num_rows
    prefixes = {f.uri: source.relative_name(f) + ID_SEPARATOR for f in new_files}
    to_read = [f for f in new_files if rows[f.uri]]
    covered = recorded_ids(store, recorded.records, gone) if to_read else pa.array([], pa.string())
    sources = SourceReader(config.rows.source_limits, s3) if config.rows.image_column is not None else None
    cutter = ShardCutter(config, first_index=recorded.next_shard, id_prefixes=prefixes, sources=sources)
    selector = _NewRowSelector(cutter, covered, prefixes)
    warnings: list[str] = []
    if to_read:
        report = scan_input(
            PromptSource(source.uri, source.filesystem, files=to_read),
            config.rows,
            ScanOptions(config.max_errors, config.read_batch_rows),
            lambda *_: selector,  # one selector sees every file, in input order
        )
        cutter.finish_file()
        report.raise_if_errors()
        warnings = row_group_warnings(report.largest_row_groups, config.shard_size)
    record = RunRecord(
        run=recorded.next_run,
        created_at=created_at or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        fingerprint=fingerprint,
        files=tuple(FileEntry(f.uri, f.size, sha[f.uri], rows[f.uri], prefixes[f.uri]) for f in new_files),
        shards=tuple(cutter.shards),
        superseded=tuple(sorted(superseded_now)),
        skipped_rows=sum(selector.skipped.values()),
    )
    return IncrementPlan(
        fingerprint,
        recorded,
        len(files),
        tuple(carried),
        record,
        selector.shard_ids(cutter.shards),
        secrets.token_hex(8),
        tuple(warnings),
    )


def _carry_over(
    recorded: RecordedPlan, committed: set[int], current: Mapping[str, tuple[int, str]]
) -> tuple[list[ShardSpec], list[int]]:
    """The uncommitted shards of earlier runs: those to run as recorded (their file is unchanged;
    `current`: uri -> (size, footer sha256) now), and the indices of those to give up."""
    carried: list[ShardSpec] = []
    superseded: list[int] = []
    for shard in recorded.live():
        if shard.index in committed:
            continue
        now = current.get(shard.file)
        if now is not None and recorded.file_entry(shard).same_content(*now):
            carried.append(shard)
        else:
            superseded.append(shard.index)
    return carried, superseded


def _files_to_read(
    files: Sequence[InputFile], sha: Mapping[str, str], recorded: RecordedPlan, gone: frozenset[int]
) -> list[InputFile]:
    """The files no record has seen as they are now, and those whose given-up shards (`gone`)
    need their rows planned again."""

    def needs_reading(f: InputFile) -> bool:
        seen = recorded.latest_file.get(f.uri)
        if seen is None or not seen[1].same_content(f.size, sha[f.uri]):
            return True
        # Unchanged since run seen[0], but shards over it were given up at or after that run
        # (it was gone for a while): read it again for the rows of those shards.
        return any(recorded.shards[i].file == f.uri and recorded.run_of[i] >= seen[0] for i in gone)

    return [f for f in files if needs_reading(f)]


def commit_increment(
    store: ObjectStore, plan: IncrementPlan, lease: OutputLease | None = None
) -> IncrementPlan | None:
    """Write the plan's ids and then its run record (create-only); returns the plan as written
    (its record names its ids), or None when another driver took this run number first (plan
    again). A plan without a record writes nothing.

    `_SUCCESS` goes before the record: the record plans shards that are not committed, and
    `_SUCCESS` must never stand next to those, whenever the driver is killed. Its removal is
    fenced by `lease` (driver.output.success.remove_success; None: tests without a driver).
    """
    record = plan.record
    if record is None:
        return plan
    if record.shards:
        record = dataclasses.replace(record, ids_key=write_ids(store, record.run, plan.token, plan.ids))
    if record.shards or record.superseded:
        remove_success(store, lease)
    if not claim_run(store, record):
        return None
    return dataclasses.replace(plan, record=record)
