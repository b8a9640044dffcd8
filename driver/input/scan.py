"""One pass over the input: every file's footer, then every row, validated (driver/input/validate.py)
and checked for duplicate ids, with the batches handed to whoever plans from them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.driver.input.arrays import plain
from ditfleet.driver.input.duplicate_ids import DIGEST_BITS, DuplicateIds
from ditfleet.driver.input.prompts import (
    DEFAULT_BATCH_ROWS,
    InputFile,
    PromptSource,
    RowCountMismatch,
    footer_row_count_error,
    iter_batches,
)
from ditfleet.driver.input.row_errors import InputError, RowError
from ditfleet.driver.input.validate import DEFAULT_MAX_ERRORS, RowValidator, ValidationReport, job_schema
from ditfleet.workers.rows import RowConfig, content_columns
from ditfleet.workers.storage.base import read_each
from ditfleet.workers.storage.input_files import largest_row_group


@dataclass(frozen=True)
class ScanOptions:
    """How the input is read: `max_errors` problems kept (all counted), `batch_rows` rows a batch,
    `workers` files side by side, `fail_fast`: nothing read past a bad footer or schema,
    `digest_bits` per id for the duplicate check."""

    max_errors: int = DEFAULT_MAX_ERRORS
    batch_rows: int = DEFAULT_BATCH_ROWS
    workers: int = 1
    fail_fast: bool = False
    digest_bits: int = DIGEST_BITS


class FileScan(Protocol):
    """What sees the batches of one file, in row order (see scan_input)."""

    def on_batch(
        self, file: InputFile, first_row: int, first_position: int, batch: pa.RecordBatch
    ) -> None: ...


# (file, first_position, rows) -> the FileScan of that file; rows: its footer's count.
PerFile = Callable[[InputFile, int, int], FileScan]


class _Footer(NamedTuple):
    """What a file's footer says, read once: its schema and row count, the footer itself (the
    row pass opens the file with it), its sha256 and its largest row group (for the plan)."""

    schema: pa.Schema
    rows: int
    metadata: pq.FileMetaData
    sha256: str


class _File(NamedTuple):
    """A file whose footer and schema are valid: its schema as the job names the columns, its
    footer's row count, and the input position of its first row."""

    file: InputFile
    footer: _Footer
    start: int


def _read_footers(
    source: PromptSource, files: Sequence[InputFile], validator: RowValidator
) -> list[_Footer | None]:
    """Each file's schema and row count, from its footer (in parallel); None, and the problem
    reported, when it cannot be read or its row count is not its row groups' sum."""

    def one(file: InputFile) -> _Footer | InputError:
        try:
            metadata, sha256 = source.footer(file)
        except InputError as e:
            return e
        lie = footer_row_count_error(file.uri, metadata)
        if lie is not None:
            return InputError([lie])
        return _Footer(metadata.schema.to_arrow_schema(), metadata.num_rows, metadata, sha256)

    footers: list[_Footer | None] = []
    for file, got in zip(files, read_each(one, files)):
        validator._order.setdefault(file.uri, len(validator._order))
        if isinstance(got, InputError):
            footers.append(None)
            for err in got.errors:
                validator.add(err)
        else:
            footers.append(got)
    return footers


def _valid_files(
    source: PromptSource, config: RowConfig, files: Sequence[InputFile], validator: RowValidator
) -> list[_File]:
    """The files whose footer reads and whose schema is valid, in input order."""
    valid: list[_File] = []
    position = 0
    for file, footer in zip(files, _read_footers(source, files, validator)):
        if footer is None or not validator.check_schema(file.uri, footer.schema):
            continue
        valid.append(_File(file, footer._replace(schema=job_schema(config, footer.schema)), position))
        position += footer.rows
    return valid


def _too_many_rows(valid: Sequence[_File], rows: int) -> RowError:
    """The digests are sized by the footers' counts before any row is read; a footer that claims
    far more rows than its pages hold must end in a message, not a traceback."""
    file, footer, _ = max(valid, key=lambda v: v.footer.rows)
    problem = (
        f"the footers claim {rows} rows in all, more than this machine can check for "
        f"duplicate ids (8 bytes a row); the largest claim is {footer.rows} rows in this file"
    )
    hint = (
        "Check the files' row counts; a damaged or hand-edited footer must be written again from its source"
    )
    return RowError(file.uri, None, None, None, problem, hint)


@dataclass
class _Reader:
    """Reads the rows of valid files: each batch checked into a validator, its ids into the
    duplicate check, then handed to the file's FileScan."""

    source: PromptSource
    config: RowConfig
    batch_rows: int
    duplicates: DuplicateIds | None
    # Files whose rows read are not their footer's count: their positions, and so every later
    # file's, are not what the footers said, so the duplicate check (by position) is skipped;
    # the input is refused for the miscount anyway.
    miscounted: list[str]

    def scan_all(
        self, valid: Sequence[_File], sinks: Sequence[FileScan | None], validator: RowValidator, workers: int
    ) -> None:
        """Every valid file, into `validator`: one after the other, or, with `workers` threads and
        FileScans to feed, side by side, each into its own validator merged in input order (the
        first errors are the first rows')."""
        if workers <= 1 or len(valid) <= 1 or all(sink is None for sink in sinks):
            for at, sink in zip(valid, sinks):
                self.scan(at, validator, sink)
            return

        def one(i: int) -> RowValidator:
            own = RowValidator(self.config, validator.max_errors)
            self.scan(valid[i], own, sinks[i])
            return own

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for own in pool.map(one, range(len(valid))):
                validator.merge(own)

    def scan(self, at: _File, sink: RowValidator, see: FileScan | None) -> None:
        try:
            self._scan(at, sink, see)
        except RowCountMismatch as e:
            self.miscounted.append(at.file.uri)
            for error in e.errors(at.file.uri):
                sink.add(error)

    def _scan(self, at: _File, sink: RowValidator, see: FileScan | None) -> None:
        (file, footer, start), config, duplicates = at, self.config, self.duplicates
        has_ids = "id" in footer.schema.names
        if duplicates is not None:
            duplicates.add_file(start, footer.rows, file.uri, has_ids)
        with self.source.open(file, footer.metadata) as pf:
            read = [config.input_name(c) for c in content_columns(footer.schema.names)]
            for first_row, in_file in iter_batches(pf, read, self.batch_rows):
                batch = config.as_job_columns(in_file)
                sink.check_batch(batch, file.uri, first_row)
                if duplicates is not None and has_ids:
                    duplicates.add_ids(plain(batch.column("id")), start + first_row)
                elif duplicates is not None:
                    duplicates.add_positions(start + first_row, batch.num_rows)
                if see is not None:
                    see.on_batch(file, first_row, start + first_row, batch)


def scan_input(
    source: PromptSource,
    config: RowConfig,
    options: ScanOptions = ScanOptions(),
    per_file: PerFile | None = None,
) -> ValidationReport:
    """Read and validate every row of the input once, in input order.

    First every file's footer is read: a file that cannot be read or whose schema is wrong is
    reported then, and with options.fail_fast (planning) nothing more is read, so a bad file
    among thousands is named before any row is. Then the rows: per_file(file, first_position,
    rows) makes one FileScan for each file whose schema is valid, in input order, which sees that
    file's batches (the columns a job reads: workers.rows.content_columns) in row order, so the
    planner shares this one pass; `options.workers` threads scan files side by side (Parquet
    decoding and Arrow compute release the GIL). The caller keeps what the FileScans hold.
    Raises InputError only when the input path cannot be resolved; all else is in the report.
    """
    files = source.files()
    validator = RowValidator(config, options.max_errors)
    valid = _valid_files(source, config, files, validator)
    rows = sum(v.footer.rows for v in valid)
    empty = tuple(v.file.uri for v in valid if v.footer.rows == 0)

    def report(rows: int) -> ValidationReport:
        return ValidationReport(
            validator.sorted_errors(),
            validator.total,
            rows,
            files,
            empty,
            footer_sha256={v.file.uri: v.footer.sha256 for v in valid},
            largest_row_groups={v.file.uri: largest_row_group(v.footer.metadata) for v in valid},
        )

    if options.fail_fast and validator.total:
        return report(0)
    try:
        # Without any id column, ids are positions, which cannot collide: no digests.
        with_ids = any("id" in v.footer.schema.names for v in valid)
        duplicates = DuplicateIds(rows, options.digest_bits, config.id_column) if with_ids else None
    except MemoryError:
        validator.add(_too_many_rows(valid, rows))
        return report(0)
    reader = _Reader(source, config, options.batch_rows, duplicates, [])
    # Made here, in input order, whatever thread then feeds them.
    sinks = [per_file(v.file, v.start, v.footer.rows) if per_file is not None else None for v in valid]
    reader.scan_all(valid, sinks, validator, options.workers)
    if duplicates is not None and not reader.miscounted:
        count, errors = duplicates.count_and_errors(
            source, max(0, options.max_errors - len(validator.errors))
        )
        for error in errors:
            validator.add(error)
        validator.total += count - len(errors)
    if rows == 0 and validator.total == 0:
        where = empty[0] if len(empty) == 1 else source.uri
        problem = (
            "the file has no rows" if len(empty) == 1 else f"the input has no rows ({len(empty)} empty files)"
        )
        hint = "Check that the prompts were written to the file(s)"
        validator.add(RowError(where, None, None, None, problem, hint))
    return report(rows)


def check_schemas(source: PromptSource, config: RowConfig, max_errors: int = DEFAULT_MAX_ERRORS) -> None:
    """The input's files, footers and schemas (the columns a job names, their types), no row
    read; raises InputError with every problem found. The first thing each command does with a
    job's input, so a missing column is the same message everywhere, before anything reads it."""
    validator = RowValidator(config, max_errors)
    _valid_files(source, config, source.files(), validator)
    if validator.total:
        raise InputError(validator.sorted_errors(), validator.total)


def validate_input(
    source: PromptSource, config: RowConfig, max_errors: int = DEFAULT_MAX_ERRORS
) -> ValidationReport:
    """Validate every row of the input; the report shows up to `max_errors` problems, counts all."""
    try:
        return scan_input(source, config, ScanOptions(max_errors=max_errors))
    except InputError as e:
        return ValidationReport(e.errors, e.total, 0, (), ())
