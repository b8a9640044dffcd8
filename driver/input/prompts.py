"""The prompt input: a file, a directory or a glob, local or s3://, as an ordered list of Parquet
files read in row-group batches (never a whole file at once).

Order matters: a row without an id takes its global position as id, so the files are sorted by
path (plain string order) and rows are counted through them in that order.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ditfleet.driver.input.row_errors import RowError, file_error
from ditfleet.workers.storage.input_files import (
    InputFileError,
    ParquetFooter,
    filesystem_for,
    fs_path,
    is_s3,
    open_parquet,
    read_footer,
    to_uri,
)

PARQUET_SUFFIX = ".parquet"
_GLOB_CHARS = frozenset("*?[")
# Rows per read batch: bounds memory per batch whatever the row group size.
DEFAULT_BATCH_ROWS = 65536


@dataclass(frozen=True)
class InputFile:
    uri: str  # absolute local path or s3://bucket/key
    size: int  # bytes


def _hidden(name: str) -> bool:
    # "_SUCCESS", "_metadata", ".DS_Store", ".part.crc": written next to data by Spark, Hive, macOS.
    return name.startswith(("_", "."))


def glob_start(parts: Sequence[str]) -> int | None:
    """The index of the first path component holding a glob character; None when none does."""
    return next((i for i, p in enumerate(parts) if _GLOB_CHARS & set(p)), None)


def _glob_match(pattern: Sequence[str], parts: Sequence[str]) -> bool:
    """Component-wise glob: '*', '?', '[..]' stay inside one path component; '**' spans any number."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(pattern[1:], parts[1:])


class PromptSource:
    """Resolves `uri` once into an ordered tuple of InputFiles and reads them in batches.

    filesystem: the pyarrow FileSystem to read through; default: the local one, or an S3 one
    with the standard AWS configuration for "s3://" (pass one built with
    workers.storage.input_files.filesystem_for(uri, endpoint_url=...) for another endpoint).
    files: the files to read, when the caller has resolved them already (an incremental run
    reads only the files its output has not seen); they are read in the order given.
    Errors are InputErrors that name the path and say what to do.
    """

    def __init__(
        self, uri: str, filesystem: pafs.FileSystem | None = None, files: Sequence[InputFile] | None = None
    ) -> None:
        self.uri = str(uri)
        self.filesystem = filesystem if filesystem is not None else filesystem_for(self.uri)
        self._s3 = is_s3(self.uri)
        self._files: tuple[InputFile, ...] | None = tuple(files) if files is not None else None

    def root(self) -> str:
        """The URI that the input's file names are relative to: the directory itself, the
        directory a glob starts in, or the directory of a single file (no trailing "/")."""
        path = fs_path(self.uri).rstrip("/")
        parts = path.split("/")
        glob_at = glob_start(parts)
        if glob_at is not None:
            base = "/".join(parts[:glob_at])
        elif any(f.uri == (self.uri if self._s3 else path) for f in self.files()):
            base = path.rsplit("/", 1)[0]  # the input is one file
        else:
            base = path
        return to_uri(base, self._s3)

    def relative_name(self, file: InputFile | str) -> str:
        """`file`'s path below root(): "2024-06-01.parquet", "day=3/part-0.parquet"."""
        uri = file.uri if isinstance(file, InputFile) else file
        root = self.root()
        if uri.startswith(root + "/"):
            return uri[len(root) + 1 :]
        return uri.rsplit("/", 1)[-1]

    def files(self) -> tuple[InputFile, ...]:
        if self._files is None:
            self._files = self._resolve()
        return self._files

    def _resolve(self) -> tuple[InputFile, ...]:
        path = fs_path(self.uri)
        parts = path.split("/")
        first_glob = glob_start(parts)
        if first_glob is not None:
            return self._glob(parts, first_glob)
        info = self.filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise file_error(self.uri, "no such file or directory", "Check the input path")
        if info.type == pafs.FileType.File:
            return (InputFile(self.uri if self._s3 else path, info.size),)
        listed = self._list(path)
        found = [i for i in listed if not _hidden(i.base_name) and i.base_name.endswith(PARQUET_SUFFIX)]
        if not found:
            others = sorted(i.base_name for i in listed)
            seen = (
                f" (it holds: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''})" if others else ""
            )
            raise file_error(
                self.uri,
                f"directory has no {PARQUET_SUFFIX} files{seen}",
                f"Put the prompts in it as *{PARQUET_SUFFIX} files (names starting with '_' or '.' are "
                "skipped), or point the input at the file itself",
            )
        return self._sorted(found)

    def _glob(self, parts: list[str], first: int) -> tuple[InputFile, ...]:
        base = "/".join(parts[:first])
        matched = [
            i
            for i in self._list(base or "/")
            if not _hidden(i.base_name)
            and _glob_match(parts[first:], i.path[len(base) :].strip("/").split("/"))
        ]
        if not matched:
            raise file_error(
                self.uri, "no files match this pattern", "Check the pattern and the directory it starts in"
            )
        return self._sorted(matched)

    def _list(self, base: str) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        return [i for i in self.filesystem.get_file_info(selector) if i.type == pafs.FileType.File]

    def _sorted(self, infos: list[pafs.FileInfo]) -> tuple[InputFile, ...]:
        return tuple(InputFile(to_uri(i.path, self._s3), i.size) for i in sorted(infos, key=lambda i: i.path))

    def open(self, file: InputFile | str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
        """Open one file (its footer is read unless `metadata` is it, from `footer`); an
        InputError naming it if it is missing or not Parquet."""
        uri = file.uri if isinstance(file, InputFile) else file
        try:
            return open_parquet(self.filesystem, uri, metadata=metadata)
        except InputFileError as e:
            raise file_error(uri, e.problem, e.hint) from e

    def footer(self, file: InputFile) -> ParquetFooter:
        """One file's footer and its sha256, from one read; an InputError as `open` gives."""
        try:
            return read_footer(self.filesystem, file.uri)
        except InputFileError as e:
            raise file_error(file.uri, e.problem, e.hint) from e


_REWRITE_HINT = (
    "Its footer does not describe its data (a damaged or hand-edited file): write the file again "
    "from its source (e.g. pyarrow.parquet.write_table), or leave it out of the input"
)


def footer_row_count_error(uri: str, metadata: pq.FileMetaData) -> RowError | None:
    """The problem when the footer's row count is not the sum of its row groups' counts.

    Readers go by the row groups, the plan by the file's count: a file claiming 2,000,000,000
    rows over 8 real ones would be planned as two billion rows. Found from the footer alone.
    """
    groups = sum(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
    if groups == metadata.num_rows:
        return None
    problem = f"the footer says {metadata.num_rows} rows but its row groups hold {groups}"
    return RowError(uri, None, None, None, problem, _REWRITE_HINT)


class RowCountMismatch(ValueError):
    """Reading a file gave other row counts than its footer claims.

    groups: (row group, rows its footer claims, rows its pages hold) for each group that differs;
    empty when only the file's total differs from what was read.
    """

    def __init__(self, claimed: int, read: int, groups: Sequence[tuple[int, int, int]]) -> None:
        self.claimed, self.read, self.groups = claimed, read, tuple(groups)
        super().__init__(f"the footer says {claimed} rows, reading gave {read}")

    def errors(self, uri: str) -> list[RowError]:
        if not self.groups:
            problem = f"the footer says {self.claimed} rows but reading the file gave {self.read}"
            return [RowError(uri, None, None, None, problem, _REWRITE_HINT)]
        return [
            RowError(
                uri,
                None,
                None,
                None,
                f"row group {g}: its footer says {claimed} rows but its pages hold {held}",
                _REWRITE_HINT,
            )
            for g, claimed, held in self.groups
        ]


def iter_batches(
    parquet: pq.ParquetFile, columns: Sequence[str] | None = None, batch_rows: int = DEFAULT_BATCH_ROWS
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first_row, batch) over a file, `batch_rows` rows at a time, only `columns` decoded.

    Raises RowCountMismatch after the last batch when the rows read are not the footer's count.
    A row group's pages decide how many rows it yields (a footer claiming more gives only the
    rows that are there; claiming fewer gives only as many), so the total read equals the
    footer's exactly when no group claims more than it holds: one pass suffices, and only a
    forged file is read again, group by group, to name the groups that lie.
    """
    row = 0
    names = list(columns) if columns is not None else None
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=names):
        yield row, batch
        row += batch.num_rows
    meta = parquet.metadata
    claimed = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if row != meta.num_rows or row != sum(claimed):
        lying = []
        if row != sum(claimed):
            for g, want in enumerate(claimed):
                held = sum(
                    b.num_rows
                    for b in parquet.iter_batches(
                        batch_size=batch_rows, row_groups=[g], columns=names[:1] if names else names
                    )
                )
                if held != want:
                    lying.append((g, want, held))
        raise RowCountMismatch(meta.num_rows, row, lying)
