"""Compaction: after _SUCCESS the union of the current shard manifests becomes one Parquet file
sorted by id, equal to the union (check_compacted), while the shard manifests stay as they were;
a redo makes it stale, visibly, and a driver's finish rebuilds it; a compaction stopped at any
write leaves the old set or the new one, never a mix; it runs under the output's lease.
Synthetic manifests with the real schema, in a local store."""

from __future__ import annotations

import io
import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.compact import (
    COMPACTED_KEY,
    COMPACTED_PREFIX,
    INDEX_KEY,
    CompactionError,
    UnionDigest,
    check_compacted,
    compact_output,
    compacted_state,
    refresh_compacted,
)
from ditfleet.driver.output.lease import OutputBusy, acquire_lease
from ditfleet.driver.output.status import output_status
from ditfleet.workers.output.layout import manifest_key, success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, read_manifests
from ditfleet.workers.storage import open_store


def _value(field: pa.Field, shard: int, i: int, tag: str):
    t = field.type
    if field.name == "id":
        return f"row-{(shard * 7919 + i * 104729) % 100003:06d}-{shard}"
    if field.name == "shard":
        return shard
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return f"{field.name}-{shard}-{i}{tag}"
    if pa.types.is_integer(t):
        return shard * 100 + i
    if pa.types.is_floating(t):
        return 0.5 * i
    if pa.types.is_boolean(t):
        return bool(i % 2)
    if pa.types.is_list(t):  # the edit job's sources: none, one or several, and a text row's null
        return None if i % 4 == 3 else [f"{field.name}-{shard}-{i}-{j}{tag}" for j in range(i % 4)]
    return None


def _table_columns(shard: int, rows: int, tag: str = "") -> dict[str, pa.Array]:
    return {
        f.name: pa.array([_value(f, shard, i, tag) for i in range(rows)], f.type) for f in MANIFEST_SCHEMA
    }


def _manifest(shard: int, rows: int, tag: str = "") -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(_table_columns(shard, rows, tag), schema=MANIFEST_SCHEMA), sink)
    return sink.getvalue()


def _output(root: Path, shards: int = 60, rows: int = 9, done: bool = True):
    store = open_store(str(root))
    for s in range(shards):
        store.put(manifest_key(s), _manifest(s, rows))
    if done:
        store.put(success_key(), b"{}")
    return store


def _sorted(table: pa.Table) -> pa.Table:
    """Rows in (id, k) order, compared by value (readers differ in what they call nullable)."""
    table = table.sort_by([("id", "ascending"), ("k", "ascending")])
    return table.cast(pa.schema([f.with_nullable(True) for f in table.schema])).combine_chunks()


def _readers_see(root: Path) -> list[pa.Table]:
    """The compacted set as the docs' readers read it: pyarrow.dataset over compacted/ and DuckDB
    over compacted/*.parquet."""
    arrow = ds.dataset(str(root / COMPACTED_PREFIX), format="parquet").to_table()
    duck = duckdb.sql(
        f"select * from read_parquet('{root / COMPACTED_PREFIX}/*.parquet')"
    ).fetch_arrow_table()
    return [arrow, duck]


def test_compaction_is_the_union_sorted_by_id_in_one_file(tmp_path: Path):
    store = _output(tmp_path / "out")
    manifests_before = {k: store.get(k) for k in store.list("manifests/")}
    report = compact_output(store, row_group_rows=64)
    assert report.rows == 540 and report.shards == 60
    assert sorted(store.list(COMPACTED_PREFIX)) == [INDEX_KEY, COMPACTED_KEY]
    union = read_manifests(store)
    for compacted in _readers_see(tmp_path / "out"):
        assert compacted.num_rows == union.num_rows
    compacted = pq.read_table(tmp_path / "out" / COMPACTED_KEY)
    ids = compacted.column("id").to_pylist()
    assert ids == sorted(ids)
    assert _sorted(compacted).equals(_sorted(union))
    assert pq.ParquetFile(tmp_path / "out" / COMPACTED_KEY).metadata.row_group(0).num_rows == 64
    # The commit record is untouched, and the set checks out.
    assert {k: store.get(k) for k in store.list("manifests/")} == manifests_before
    assert compacted_state(store).current
    assert check_compacted(store) == []


def test_compaction_cut_into_many_id_ranges_makes_the_same_sorted_union(tmp_path: Path):
    # 540 rows in ranges of about 50: the bounded-memory path (spill by range, sort each) taken.
    store = _output(tmp_path / "out")
    report = compact_output(store, row_group_rows=64, range_rows=50)
    compacted = pq.read_table(tmp_path / "out" / COMPACTED_KEY)
    ids = compacted.column("id").to_pylist()
    assert report.rows == 540 and ids == sorted(ids)
    assert _sorted(compacted).equals(_sorted(read_manifests(store)))
    assert check_compacted(store) == []


@pytest.mark.slow
def test_check_finds_a_compacted_set_that_is_not_the_union(tmp_path: Path):
    store = _output(tmp_path / "out")
    compact_output(store)
    path = tmp_path / "out" / COMPACTED_KEY
    table = pq.read_table(path)
    pq.write_table(table.slice(1), path)  # a row dropped
    problems = "\n".join(check_compacted(store))
    assert "rows, its index says" in problems and "not the union of the shard manifests" in problems
    # Compacting again repairs it; a value changed in place (same row count) is caught too.
    compact_output(store)
    assert check_compacted(store) == []
    prompts = table.column("prompt").to_pylist()
    prompts[3] = "changed"
    at = table.schema.get_field_index("prompt")
    pq.write_table(table.set_column(at, table.schema.field(at), pa.array(prompts)), path)
    assert any("not the union" in p for p in check_compacted(store))
    # A stray file and a missing index are named.
    compact_output(store)
    store.put(COMPACTED_PREFIX + "extra.parquet", b"x")
    assert any("stray object" in p for p in check_compacted(store))
    store.delete(INDEX_KEY)
    assert not compacted_state(store).current
    assert any("_index.json is missing or unreadable" in p for p in check_compacted(store))


def test_a_redo_makes_the_set_stale_visibly_and_the_finish_rebuilds_it(tmp_path: Path):
    store = _output(tmp_path / "out", shards=6, rows=4)
    compact_output(store)
    before = pq.read_table(tmp_path / "out" / COMPACTED_KEY)
    # Shard 2 redone: its next manifest generation, with other rows, supersedes the first.
    store.put(manifest_key(2, 1), _manifest(2, 4, tag="-redo"))
    state = compacted_state(store)
    assert state.present and not state.current and "shards [2] were redone" in state.why
    assert "STALE" in output_status(store).format_text()
    assert any("STALE" in p for p in check_compacted(store))
    # The driver's finish (every shard committed) rebuilds it; a current set is left alone.
    assert refresh_compacted(store, None) is not None
    after = pq.read_table(tmp_path / "out" / COMPACTED_KEY)
    assert not _sorted(after).equals(_sorted(before))
    assert _sorted(after).equals(_sorted(read_manifests(store)))
    assert check_compacted(store) == []
    assert refresh_compacted(store, None) is None
    # An output that was never compacted is not made to be.
    fresh = _output(tmp_path / "fresh", shards=2, rows=2)
    assert refresh_compacted(fresh, None) is None
    assert not list(fresh.list(COMPACTED_PREFIX))


class _Stop(Exception):
    pass


@pytest.mark.parametrize("where", ["lease_check", "put_file", "index"])
def test_a_compaction_stopped_at_any_write_leaves_the_old_set_or_the_new_never_a_mix(tmp_path: Path, where):
    store = _output(tmp_path / "out", shards=20, rows=5)
    compact_output(store, row_group_rows=64)
    old = _sorted(pq.read_table(tmp_path / "out" / COMPACTED_KEY))
    # A redo of shard 3, then a second compaction with other settings that stops at `where`.
    store.put(manifest_key(3, 1), _manifest(3, 5, tag="-redo"))
    new = _sorted(read_manifests(store))

    def stop() -> None:
        raise _Stop

    put_file_if = store.put_file_if
    if where == "put_file":
        store.put_file_if = lambda *a, **k: stop()  # type: ignore[method-assign]
    if where == "index":
        store.put_file_if = lambda key, *a, **k: stop() if key == INDEX_KEY else put_file_if(key, *a, **k)  # type: ignore[method-assign]
    lease = acquire_lease(store, renew=False)
    if where == "lease_check":  # another process took the output meanwhile
        acquire_lease(store, ttl_s=60, renew=False, clock=lambda: lease.expires_at + 1)
    with pytest.raises(OutputBusy if where == "lease_check" else _Stop):
        compact_output(store, row_group_rows=16, lease=lease, finished=True)
    store.put_file_if = put_file_if  # type: ignore[method-assign]
    for seen in _readers_see(tmp_path / "out"):
        assert _sorted(seen).equals(old if where != "index" else new)
    # Never believed current when it is not: the old set reads as stale; the new one without its
    # index reads as stale too (the index still describes the old), and compacting again mends it.
    assert not compacted_state(store).current
    compact_output(store)
    assert check_compacted(store) == []


def test_the_earlier_layouts_files_are_replaced(tmp_path: Path):
    store = _output(tmp_path / "out", shards=4, rows=3)
    store.put(COMPACTED_PREFIX + "part-00000.parquet", _manifest(0, 3))
    store.put(COMPACTED_PREFIX + "part-00001.parquet", _manifest(1, 3))
    assert not compacted_state(store).current
    compact_output(store)
    assert sorted(store.list(COMPACTED_PREFIX)) == [INDEX_KEY, COMPACTED_KEY]
    assert check_compacted(store) == []


def test_an_unfinished_output_is_refused_and_no_compacted_set_is_fine(tmp_path: Path):
    store = _output(tmp_path / "out", shards=3, done=False)
    assert check_compacted(store) == []
    assert not compacted_state(store).present
    with pytest.raises(CompactionError, match="no valid _SUCCESS"):
        compact_output(store)


def test_ditfleet_compact_command_runs_under_the_lease(tmp_path: Path, capsys):
    from ditfleet.jobs.cli import main

    store = _output(tmp_path / "out", shards=5, rows=4)
    held = acquire_lease(store, renew=False)
    assert main(["compact", str(tmp_path / "out")]) == 2
    assert "being written by another" in capsys.readouterr().err
    assert not list(store.list(COMPACTED_PREFIX))
    held.release()
    assert main(["compact", str(tmp_path / "out")]) == 0
    assert "20 manifest rows of 5 shards into compacted/manifests.parquet" in capsys.readouterr().out
    assert (tmp_path / "out" / COMPACTED_KEY).exists()


def test_compacting_a_finished_output_leaves_it_finished(tmp_path: Path, capsys):
    """The compaction's lease is newer than the _SUCCESS a driver stamped: it stamps it anew,
    so the output is not taken for unfinished afterwards."""
    from ditfleet.driver.output.success import put_success, success_file
    from ditfleet.jobs.cli import main

    store = _output(tmp_path / "out", shards=3, rows=2, done=False)
    driver = acquire_lease(store, renew=False)
    put_success(store, {"status": "ok"}, driver.generation)
    driver.release()
    assert main(["compact", str(tmp_path / "out")]) == 0
    assert success_file(store).doc is not None and success_file(store).stale is None
    assert "complete" in output_status(store).format_text().splitlines()[0]


def test_a_compaction_that_lost_its_lease_writes_nothing(tmp_path: Path):
    store = _output(tmp_path / "out", shards=3, rows=2)
    lease = acquire_lease(store, renew=False)
    acquire_lease(store, ttl_s=60, renew=False, clock=lambda: lease.expires_at + 1)  # taken over
    with pytest.raises(OutputBusy):
        compact_output(store, lease=lease, finished=True)
    assert not list(store.list(COMPACTED_PREFIX))


def _forge_same_digest(value: str) -> str:
    """Another printable string of the same length whose 64-bit `value_digests` digest equals
    `value`'s: its first two words chosen so that the hash chain meets again (every step of the
    chain is invertible), about 3,000 candidates for one hit. What the issue's tamperer did."""
    from ditfleet.workers.value_digests import _MUL, _MUL2, _SEED, _STEP, digests, mix

    data = value.encode()
    assert len(data) >= 16
    m64 = (1 << 64) - 1

    def unmix(h: int) -> int:
        h ^= h >> 33
        h = (h * pow(int(_MUL2), -1, 1 << 64)) & m64
        h ^= h >> 33
        h = (h * pow(int(_MUL), -1, 1 << 64)) & m64
        return h ^ (h >> 33)

    words = np.frombuffer(data[:16], "<u8")
    h0 = np.uint64((len(data) * int(_STEP)) & m64) ^ _SEED
    with np.errstate(over="ignore"):
        h2 = mix(mix(np.array([h0 * _STEP ^ words[0]])) * _STEP ^ words[1])[0]
        rng = np.random.default_rng(0)
        for _ in range(20):
            first = rng.integers(0x21, 0x7F, (200_000, 8), np.uint8)
            h1 = mix((h0 * _STEP) ^ first.view("<u8")[:, 0])
            second = (np.uint64(unmix(int(h2))) ^ (h1 * _STEP)).view(np.uint8).reshape(-1, 8)
            ok = np.flatnonzero(((second >= 0x21) & (second < 0x7F)).all(axis=1))
            for i in ok:
                forged = (first[i].tobytes() + second[i].tobytes() + data[16:]).decode()
                if forged != value:
                    assert digests(pa.array([forged]))[0] == digests(pa.array([value]))[0]
                    return forged
    raise AssertionError("no forgery found")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (["ab", "c"], ["a", "bc"]),  # the same characters, cut elsewhere
        ([], [""]),
        ([""], None),
        ([None], None),
        (["x", "y"], ["y", "x"]),  # the column order of the sources is part of the row
    ],
)
def test_the_digest_takes_the_source_lists_whole(before, after):
    """Rows that differ only in a source list (where its elements are cut, empty vs null, order)
    have different digests, so a compacted set with such a change is not taken for the union."""
    row = pa.table(_table_columns(0, 1), schema=MANIFEST_SCHEMA)
    digests = []
    for value in (before, after):
        for name in ("source_uris", "source_sha256"):
            at = MANIFEST_SCHEMA.get_field_index(name)
            row = row.set_column(
                at, MANIFEST_SCHEMA.field(at), pa.array([value], MANIFEST_SCHEMA.field(at).type)
            )
        digest = UnionDigest()
        digest.add(row)
        digests.append(digest.sha256())
    assert digests[0] != digests[1]


def test_a_tampered_set_that_matches_the_old_64_bit_digest_is_caught(tmp_path: Path):
    # Issue 48, item 6: the set's digest was built from 64-bit non-cryptographic row digests
    # (power sums of MurmurHash-style chains), which a tamperer matches by construction. One row's
    # uri is pointed elsewhere with a value of the same 64-bit digest: every row digest, and so the
    # old index's sums, stay equal. The sha256 digest of the rows is not matched that way.
    store = open_store(str(tmp_path / "out"))
    for s in range(6):
        store.put(manifest_key(s), _manifest(s, 9, tag="-images/00001/a1-1234.png"))
    store.put(success_key(), b"{}")
    compact_output(store)
    path = tmp_path / "out" / COMPACTED_KEY
    table = pq.read_table(path)
    uris = table.column("uri").to_pylist()
    uris[0] = _forge_same_digest(uris[0])
    at = table.schema.get_field_index("uri")
    pq.write_table(table.set_column(at, table.schema.field(at), pa.array(uris)), path)
    problems = check_compacted(store)
    assert any("not the union of the shard manifests" in p for p in problems), problems
    # An index of the earlier digest is not believed: the set reads as stale until compacted again.
    index = json.loads(store.get(INDEX_KEY))
    store.put(INDEX_KEY, json.dumps({**index, "version": 2}).encode())
    assert "of an earlier version" in compacted_state(store).why
