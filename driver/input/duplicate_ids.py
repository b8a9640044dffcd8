"""Finding ids used by more than one row, over all input files, in 8 bytes per row.

Each row's id (its `id` value as a string, integers in decimal, or its input position for a file
without an id column) is reduced to a 64-bit hash and kept in an Arrow int64 array. After the
pass, only the hashes seen more than once are looked up again in the files, so a reported
duplicate is a real one (never a hash collision) and the message names the rows that share it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.input.prompts import PromptSource, iter_batches
from ditfleet.driver.input.row_errors import RowError, describe_value

_HINT = "Ids must be unique across all input files; fix or drop the duplicate rows"


@dataclass(frozen=True)
class _Span:
    """The rows of one file in the global order of rows."""

    start: int  # global position of its row 0
    rows: int
    uri: str
    has_ids: bool  # False: a row's id is its position


@dataclass(frozen=True)
class _Seen:
    file: str
    row: int
    id: str
    has_ids: bool


class DuplicateIds:
    """Collects id hashes file by file, in input order, then reports the duplicates."""

    def __init__(self) -> None:
        self._hashes: list[pa.Array] = []  # int64, one per row, in global position order
        self._spans: list[_Span] = []

    def add_file(self, start: int, rows: int, uri: str, has_ids: bool) -> None:
        self._spans.append(_Span(start, rows, uri, has_ids))

    def add_positions(self, first_position: int, n: int) -> None:
        """Rows of a file without an id column: their ids are their positions."""
        self._hashes.append(
            pa.array([hash(str(p)) for p in range(first_position, first_position + n)], pa.int64())
        )

    def add_ids(self, ids: pa.Array, first_position: int) -> None:
        """`ids`: string or integer array. Python's str hash is salted per process, which is fine:
        the hashes are compared within this process only."""
        if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
            ids = ids.cast(pa.string())  # integers in decimal: 7 and "7" are the same id
        # A null (reported elsewhere) hashes by its position, so nulls are not also duplicates.
        values = ids.to_pylist()
        hashes = [
            hash(v) if v is not None else hash((None, first_position + i)) for i, v in enumerate(values)
        ]
        self._hashes.append(pa.array(hashes, pa.int64()))

    def _candidates(self) -> list[int]:
        """Global positions whose hash occurs more than once."""
        if not self._hashes:
            return []
        hashes = pa.chunked_array(self._hashes, pa.int64()).combine_chunks()
        counts = pc.value_counts(hashes)
        repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
        if len(repeated) == 0:
            return []
        return pc.indices_nonzero(pc.is_in(hashes, value_set=repeated)).to_pylist()

    def _look_up(self, source: PromptSource, positions: Sequence[int]) -> dict[int, _Seen]:
        """The real ids at `positions`, read again from the files (only their id column)."""
        out: dict[int, _Seen] = {}
        wanted = set(positions)
        for span in self._spans:
            here = [p for p in positions if span.start <= p < span.start + span.rows]
            if not here:
                continue
            if not span.has_ids:
                out.update({p: _Seen(span.uri, p - span.start, str(p), False) for p in here})
                continue
            with source.open(span.uri) as pf:
                for first_row, batch in iter_batches(pf, ["id"]):
                    for i, v in enumerate(batch.column("id").to_pylist()):
                        if span.start + first_row + i in wanted and v is not None:
                            out[span.start + first_row + i] = _Seen(span.uri, first_row + i, str(v), True)
        return out

    def errors(self, source: PromptSource) -> list[RowError]:
        """One error per row whose id an earlier row already has, naming that earlier row."""
        candidates = self._candidates()
        if not candidates:
            return []
        seen = self._look_up(source, candidates)
        groups: dict[str, list[_Seen]] = defaultdict(list)
        for position in sorted(seen):
            groups[seen[position].id].append(seen[position])
        out = []
        for row_id, rows in groups.items():
            first = f"{rows[0].file} row {rows[0].row}"
            if not rows[0].has_ids:
                first += " (a file without an id column: its rows' ids are their input positions)"
            for dup in rows[1:]:
                if dup.has_ids:
                    message = f"id {row_id!r} is already used by {first}"
                else:
                    message = f"this file has no id column, so the row's id is its input position, {row_id!r}, already used by {first}"
                out.append(RowError(dup.file, dup.row, "id", describe_value(row_id), message, _HINT))
        return out
