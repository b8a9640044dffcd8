"""Compaction: after _SUCCESS the union of the shard manifests becomes a few large Parquet files
sorted by id, equal to the union (checked by check_compacted), while the shard manifests stay
as they were. Synthetic manifests with the real schema, in a local store."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.compact import (
    COMPACTED_PREFIX,
    INDEX_KEY,
    CompactionError,
    check_compacted,
    compact_output,
)
from ditfleet.workers.output.layout import manifest_key, success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, read_manifests
from ditfleet.workers.storage import open_store


def _value(field: pa.Field, shard: int, i: int):
    t = field.type
    if field.name == "id":
        return f"row-{(shard * 7919 + i * 104729) % 100003:06d}-{shard}"
    if field.name == "shard":
        return shard
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return f"{field.name}-{shard}-{i}"
    if pa.types.is_integer(t):
        return shard * 100 + i
    if pa.types.is_floating(t):
        return 0.5 * i
    if pa.types.is_boolean(t):
        return bool(i % 2)
    return None


def _manifest(shard: int, rows: int) -> bytes:
    columns = {f.name: pa.array([_value(f, shard, i) for i in range(rows)], f.type) for f in MANIFEST_SCHEMA}
    sink = io.BytesIO()
    pq.write_table(pa.table(columns, schema=MANIFEST_SCHEMA), sink)
    return sink.getvalue()


def _output(root: Path, shards: int = 60, rows: int = 9, done: bool = True):
    store = open_store(str(root))
    for s in range(shards):
        store.put(manifest_key(s), _manifest(s, rows))
    if done:
        store.put(success_key(), b"{}")
    return store


def test_compaction_is_the_union_sorted_by_id_in_a_few_files(tmp_path: Path):
    store = _output(tmp_path / "out")
    manifests_before = {k: store.get(k) for k in store.list("manifests/")}
    report = compact_output(store, rows_per_file=200, row_group_rows=64)
    assert report.rows == 540 and report.shards == 60
    assert 2 <= len(report.files) <= 5
    union = read_manifests(store)
    compacted = ds.dataset(str(tmp_path / "out" / COMPACTED_PREFIX), format="parquet").to_table()
    assert compacted.num_rows == union.num_rows
    ids = compacted.column("id").to_pylist()
    assert ids == sorted(ids)
    key = ["id", "k"]
    assert compacted.sort_by([(c, "ascending") for c in key]).equals(
        union.sort_by([(c, "ascending") for c in key]).replace_schema_metadata(compacted.schema.metadata)
    )
    first = pq.ParquetFile(tmp_path / "out" / report.files[0].key)
    assert first.metadata.row_group(0).num_rows == 64
    # The commit record is untouched, and the set checks out.
    assert {k: store.get(k) for k in store.list("manifests/")} == manifests_before
    assert check_compacted(store) == []


def test_check_finds_a_compacted_set_that_is_not_the_union(tmp_path: Path):
    store = _output(tmp_path / "out")
    report = compact_output(store, rows_per_file=200)
    # A row dropped from one compacted file.
    path = tmp_path / "out" / report.files[1].key
    table = pq.read_table(path)
    pq.write_table(table.slice(1), path)
    problems = "\n".join(check_compacted(store))
    assert "rows, its index says" in problems and "not the union of the shard manifests" in problems
    # Compacting again repairs it; a value changed in place (same row count) is caught too.
    compact_output(store, rows_per_file=200)
    assert check_compacted(store) == []
    table = pq.read_table(path)
    prompts = table.column("prompt").to_pylist()
    prompts[3] = "changed"
    pq.write_table(
        table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(prompts)), path
    )
    assert any("not the union" in p for p in check_compacted(store))
    # A stray file and a missing index are named.
    store.put(COMPACTED_PREFIX + "extra.parquet", b"x")
    assert any("stray object" in p for p in check_compacted(store))
    store.delete(INDEX_KEY)
    assert any("no index" in p for p in check_compacted(store))


def test_an_unfinished_output_is_refused_and_no_compacted_set_is_fine(tmp_path: Path):
    store = _output(tmp_path / "out", shards=3, done=False)
    assert check_compacted(store) == []
    with pytest.raises(CompactionError, match="no _SUCCESS yet"):
        compact_output(store)


def test_ditfleet_compact_command(tmp_path: Path, capsys):
    from ditfleet.jobs.cli import main

    _output(tmp_path / "out", shards=5, rows=4)
    assert main(["compact", str(tmp_path / "out")]) == 0
    assert "20 manifest rows of 5 shards into 1 file(s)" in capsys.readouterr().out
    assert (tmp_path / "out" / "compacted" / "part-00000.parquet").exists()
