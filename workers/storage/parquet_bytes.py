"""A Parquet object read from its bytes (`store.get`): manifests, run records, the plan, side tables.

Every such read goes through here, in the calling thread (`use_threads=False`) on a
`pa.BufferReader`. Why: a threaded read decodes its columns as tasks on Arrow's thread pool, and
the last task to finish drops the reader, whose buffers Python owns (bytes, or a Python file
object's reads). Dropping them takes the GIL. When that happens while the interpreter exits, Python
ends the Arrow thread inside a C++ destructor and the process aborts after its work is done
("terminate called without an active exception", exit -6): `ditfleet status` printed its answer
and then failed. Objects read this way are small (a shard's manifest); callers that read many run
their own threads, which is where the parallelism pays anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq


def read_parquet(
    data: bytes, columns: Sequence[str] | None = None, if_present: Sequence[str] = ()
) -> pa.Table:
    """The table in `data`: `columns` (all when None), plus those of `if_present` the file has
    (columns that objects written by older versions lack). Raises pa.ArrowInvalid on what is not
    Parquet or lacks a column of `columns` (ParquetFile.read alone would leave it out silently)."""
    parquet = pq.ParquetFile(pa.BufferReader(data))
    if columns is not None:
        names = parquet.schema_arrow.names
        if missing := [c for c in columns if c not in names]:
            raise pa.ArrowInvalid(f"no column {missing} in this Parquet object (it has {names})")
        columns = [*columns, *(c for c in if_present if c in names)]
    return parquet.read(columns=columns, use_threads=False)
