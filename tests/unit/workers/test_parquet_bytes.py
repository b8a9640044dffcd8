"""workers.storage.parquet_bytes: a Parquet object read from its bytes, in the calling thread.

A threaded read of Python-owned bytes can abort the process as it exits, after its work is done
(CI: `ditfleet status --json` printed its answer, then died of SIGABRT, "terminate called without
an active exception"; the module's docstring says why). The race is rare (about 1 exit in 250 on a
loaded 2-core machine), so no test waits for it: these check what the reader returns, and that every
read of Parquet from bytes in the code goes through it.
"""

from __future__ import annotations

import ast
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.paths import REPO

HELPER = "workers/storage/parquet_bytes.py"
# All our Python: the five layers, the installed face, the benchmarks, and the tests (a pytest
# worker or a test's child process that aborts at exit fails the run as surely).
SOURCE_FOLDERS = ("model", "compile", "workers", "driver", "jobs", "ditfleet", "bench", "recipes", "tests")
# Reads that decode row groups. A footer alone (read_schema, read_metadata) is read in the calling
# thread, so those are left out.
PARQUET_READS = {"read_table", "ParquetFile"}
IN_MEMORY_SOURCES = {"BytesIO", "BufferReader", "py_buffer"}


def _bytes(table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(metadata), buf)
    return buf.getvalue()


def test_reads_the_columns_asked_for_and_those_of_if_present_the_file_has():
    data = _bytes(pa.table({"id": ["a", "b"], "status": ["ok", "failed"], "phash": [1, 2]}))
    assert read_parquet(data).column_names == ["id", "status", "phash"]
    assert read_parquet(data, ["id"]).to_pydict() == {"id": ["a", "b"]}
    got = read_parquet(data, ["id"], if_present=["phash", "gate_passed"])
    assert got.to_pydict() == {"id": ["a", "b"], "phash": [1, 2]}


def test_a_missing_required_column_and_bytes_that_are_not_parquet_raise():
    data = _bytes(pa.table({"id": ["a"]}))
    with pytest.raises(pa.ArrowInvalid, match=r"no column \['uri'\]"):
        read_parquet(data, ["id", "uri"])
    with pytest.raises(pa.ArrowInvalid):
        read_parquet(b"not parquet at all")


def _reads_from_memory(tree: ast.AST) -> list[int]:
    """Lines of `pq.<read>(<in-memory source>(...), ...)` calls."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Call)):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        source = node.args[0].func
        source_name = source.attr if isinstance(source, ast.Attribute) else getattr(source, "id", "")
        if name in PARQUET_READS and source_name in IN_MEMORY_SOURCES:
            lines.append(node.lineno)
    return lines


def test_every_read_of_parquet_from_bytes_goes_through_read_parquet():
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == HELPER:
                continue
            found += [f"{rel}:{line}" for line in _reads_from_memory(ast.parse(path.read_text(), rel))]
    assert not found, (
        f"Parquet decoded from in-memory bytes outside {HELPER}: {found}. Use read_parquet "
        "(a threaded read of Python-owned bytes can abort the process at exit)."
    )


def test_the_check_finds_such_a_read():
    """The check above is not vacuous: it finds each spelling it looks for."""
    code = (
        "pq.read_table(io.BytesIO(b))\npq.ParquetFile(pa.BufferReader(b)).read()\nread_table(BytesIO(b))\n"
        "pq.read_schema(io.BytesIO(b))\n"
    )
    assert sorted(_reads_from_memory(ast.parse(code))) == [1, 2, 3]
