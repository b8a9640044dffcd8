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

from ditfleet.driver.input.row_errors import file_error
from ditfleet.workers.storage.input_files import (
    InputFileError,
    filesystem_for,
    fs_path,
    is_s3,
    open_parquet,
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
        self,
        uri: str,
        filesystem: pafs.FileSystem | None = None,
        files: Sequence[InputFile] | None = None,
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
        glob_at = next((i for i, p in enumerate(parts) if _GLOB_CHARS & set(p)), None)
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
        if any(_GLOB_CHARS & set(p) for p in parts):
            return self._glob(parts)
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

    def _glob(self, parts: list[str]) -> tuple[InputFile, ...]:
        first = next(i for i, p in enumerate(parts) if _GLOB_CHARS & set(p))
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

    def open(self, file: InputFile | str) -> pq.ParquetFile:
        """Open one file's footer; an InputError naming it if it is missing or not Parquet."""
        uri = file.uri if isinstance(file, InputFile) else file
        try:
            return open_parquet(self.filesystem, uri)
        except InputFileError as e:
            raise file_error(uri, e.problem, e.hint) from e


def iter_batches(
    parquet: pq.ParquetFile, columns: Sequence[str] | None = None, batch_rows: int = DEFAULT_BATCH_ROWS
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first_row, batch) over a file, `batch_rows` rows at a time, only `columns` decoded."""
    row = 0
    for batch in parquet.iter_batches(
        batch_size=batch_rows, columns=list(columns) if columns is not None else None
    ):
        yield row, batch
        row += batch.num_rows
