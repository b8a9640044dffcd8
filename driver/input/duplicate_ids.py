"""Finding ids used by more than one row, over all input files, in 8 bytes per row.

Each row's id (its `id` value as a string, integers in decimal, or its input position for a file
without an id column) is reduced to a 64-bit digest (workers.value_digests) written into one
preallocated numpy array at the row's global position; no Python object per row is made. After
the pass the array is sorted in place and equal neighbours give the digests seen more than once.
Only when there are any are the files read again (the id column alone), and the rows whose
digest repeats are compared by their real ids, in Arrow: a reported duplicate is a real one
(never a digest collision) and the message names the rows that share it.

Memory: 8 bytes per input row for the digests, plus the ids of the rows whose digest repeats.
Files may be added from several threads at once: each writes its own slice of the array.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.input.prompts import PromptSource, iter_batches
from ditfleet.driver.input.row_errors import RowError, describe_value
from ditfleet.workers.value_digests import digests, position_digests

_HINT = "Ids must be unique across all input files; fix or drop the duplicate rows"
DIGEST_BITS = 64


@dataclass(frozen=True)
class _Span:
    """The rows of one file in the global order of rows."""

    start: int  # global position of its row 0
    rows: int
    uri: str
    has_ids: bool  # False: a row's id is its position


class DuplicateIds:
    """Collects id digests file by file, then reports the duplicates.

    total_rows: rows of all files that will be added (their footers say), so the digest array
    is allocated once. bits: digest width; below 64 only to force collisions in tests.
    """

    def __init__(
        self, total_rows: int, bits: int = DIGEST_BITS, id_column: str = "id", fold_case: bool = False
    ) -> None:
        self.id_column = id_column  # the input's name of the id column (RowConfig.id_column)
        # Ids equal once ASCII letters are lowered count as one (an output on a store that folds
        # case, driver.output.case_fold); only ASCII: an object key escapes every other byte.
        self.fold_case = fold_case
        if not 1 <= bits <= 64:
            raise ValueError(f"digest bits must be in [1, 64], got {bits}")
        self.bits = bits
        self._digests = np.zeros(total_rows, np.uint64)
        self._spans: list[_Span] = []

    def add_file(self, start: int, rows: int, uri: str, has_ids: bool) -> None:
        if start + rows > len(self._digests):
            raise ValueError(f"{uri}: rows {start}..{start + rows} beyond the {len(self._digests)} announced")
        self._spans.append(_Span(start, rows, uri, has_ids))

    def add_positions(self, first_position: int, n: int) -> None:
        """Rows of a file without an id column: their ids are their positions."""
        self._digests[first_position : first_position + n] = position_digests(first_position, n, self.bits)

    def add_ids(self, ids: pa.Array, first_position: int) -> None:
        """`ids`: string or integer array (integers count in decimal: 7 and "7" are one id)."""
        n = len(ids)
        positions = np.arange(first_position, first_position + n, dtype=np.int64)
        self._digests[first_position : first_position + n] = digests(self._key(ids), self.bits, positions)

    def _key(self, ids: pa.Array) -> pa.Array:
        """What makes two ids one: the id, or with fold_case its ASCII letters lowered."""
        if not self.fold_case:
            return ids
        if isinstance(ids, pa.DictionaryArray):
            ids = ids.dictionary_decode()
        return (
            pc.ascii_lower(ids) if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type) else ids
        )

    def _repeated(self) -> np.ndarray:
        """The digests that occur more than once, sorted (the digest array is sorted in place:
        nothing needs it in row order afterwards)."""
        self._spans.sort(key=lambda s: s.start)
        used = sum(s.rows for s in self._spans)
        if used < len(self._digests):  # positions of left-out files: keep only the spans' slices
            self._digests = np.concatenate([self._digests[s.start : s.start + s.rows] for s in self._spans])
        if len(self._digests) < 2:
            return np.empty(0, np.uint64)
        d = self._digests
        d.sort()
        same = d[1:] == d[:-1]
        repeated = np.unique(d[1:][same])
        self._digests = np.empty(0, np.uint64)  # the pass is over: free 8 bytes per row
        return repeated

    def _candidates(self, source: PromptSource, repeated: np.ndarray) -> pa.Table:
        """(position, id) of every non-null row whose digest repeats, read again from the files."""
        positions: list[pa.Array] = []
        ids: list[pa.Array] = []
        keys: list[pa.Array] = []
        for span in self._spans:
            if not span.has_ids:
                for at in range(0, span.rows, 1 << 20):
                    n = min(1 << 20, span.rows - at)
                    hit = _hits(position_digests(span.start + at, n, self.bits), repeated)
                    if len(hit):
                        where = pa.array(hit + span.start + at, pa.int64())
                        positions.append(where)
                        ids.append(where.cast(pa.large_string()))
                        keys.append(ids[-1])
                continue
            with source.open(span.uri) as pf:
                for first_row, batch in iter_batches(pf, [self.id_column]):
                    column = batch.column(self.id_column)
                    start = span.start + first_row
                    where = np.arange(start, start + batch.num_rows, dtype=np.int64)
                    hit = _hits(digests(self._key(column), self.bits, where), repeated)
                    if not len(hit):
                        continue
                    taken = column.take(pa.array(hit))
                    valid = pc.is_valid(taken)
                    values = taken.filter(valid)
                    if isinstance(values, pa.DictionaryArray):
                        values = values.dictionary_decode()
                    positions.append(pa.array(hit + start, pa.int64()).filter(valid))
                    ids.append(values.cast(pa.large_string()))
                    keys.append(self._key(values).cast(pa.large_string()))
        if not positions:
            empty = pa.array([], pa.large_string())
            return pa.table({"position": pa.array([], pa.int64()), "id": empty, "key": empty})
        return pa.table(
            {
                "position": pa.concat_arrays(positions),
                "id": pa.concat_arrays(ids),
                "key": pa.concat_arrays(keys),
            }
        )

    def count_and_errors(self, source: PromptSource, max_errors: int) -> tuple[int, list[RowError]]:
        """(rows whose id an earlier row has, errors for the first `max_errors` of them in input
        order), each naming the earliest row with that id."""
        repeated = self._repeated()
        if not len(repeated):
            return 0, []
        table = self._candidates(source, repeated)
        if table.num_rows < 2:
            return 0, []
        table = table.sort_by([("key", "ascending"), ("position", "ascending")])
        same_as_previous = np.zeros(table.num_rows, bool)
        column = table.column("key").combine_chunks()
        same_as_previous[1:] = np.asarray(
            pc.equal(column.slice(1), column.slice(0, len(column) - 1)).to_numpy(zero_copy_only=False)
        )
        index = np.arange(table.num_rows)
        group_first = np.maximum.accumulate(np.where(same_as_previous, 0, index))
        dups = np.flatnonzero(same_as_previous)
        if not len(dups):
            return 0, []
        positions = table.column("position").to_numpy()
        shown = dups[np.argsort(positions[dups], kind="stable")[:max_errors]]
        out = []
        for i in shown.tolist():
            first, dup = self._locate(int(positions[group_first[i]])), self._locate(int(positions[i]))
            row_id = table.column("id")[i].as_py()
            where = f"{first[0].uri} row {first[1]}"
            if not first[0].has_ids:
                where += " (a file without an id column: its rows' ids are their input positions)"
            first_id = table.column("id")[int(group_first[i])].as_py()
            if self.fold_case and first_id != row_id:
                message = (
                    f"id {row_id!r} differs only in case from id {first_id!r} of {where}, and the "
                    "output's store does not tell case apart (a macOS or Windows volume, an SMB "
                    "share): their images would be one file, the second replacing the first"
                )
                hint = "Make these ids differ by more than case, or write to an output that tells case apart (s3://, a Linux filesystem)"
                out.append(
                    RowError(dup[0].uri, dup[1], self.id_column, describe_value(row_id), message, hint)
                )
                continue
            if dup[0].has_ids:
                message = f"id {row_id!r} is already used by {where}"
            else:
                message = f"this file has no id column, so the row's id is its input position, {row_id!r}, already used by {where}"
            out.append(RowError(dup[0].uri, dup[1], self.id_column, describe_value(row_id), message, _HINT))
        return len(dups), out

    def _locate(self, position: int) -> tuple[_Span, int]:
        starts = [s.start for s in self._spans]
        span = self._spans[bisect.bisect_right(starts, position) - 1]
        return span, position - span.start


def _hits(d: np.ndarray, repeated: np.ndarray) -> np.ndarray:
    """Indices of `d` whose value is in the sorted `repeated`."""
    at = np.searchsorted(repeated, d)
    at[at == len(repeated)] = 0
    return np.flatnonzero(repeated[at] == d)
