"""Duplicate ids at 100M-row scale: fixed-width digests in numpy, sort-based, and an exact check of
the real ids whenever digests collide, so a collision (forced here with tiny digests) never
reports a duplicate that is not one and never hides one that is. And a bad file among many is
named from the footers, before any row is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ditfleet.driver.input.scan as scan_module
from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.input.duplicate_ids import DuplicateIds
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.value_digests import digests, position_digests

CONFIG = PlanConfig(rows=RowConfig(buckets=default_buckets("tiny")), shard_size=7)


def _write(path: Path, ids: list | None, n: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(ids) if ids is not None else n
    columns: dict = {"prompt": [f"a photo of thing {i}" for i in range(n)]}
    if ids is not None:
        columns = {"id": ids, **columns}
    pq.write_table(pa.table(columns), path, row_group_size=16)


def test_a_digest_depends_on_the_id_alone():
    values = ["", "a", "abcdefgh", "abcdefghi", "x" * 100, "héllo wörld", "7"]
    d = digests(pa.array(values))
    assert len(set(d.tolist())) == len(values)
    # Another batch around it, a slice, large strings, dictionary encoding: the same digests.
    assert (digests(pa.array(["zz", *values, "q"]).slice(1, len(values))) == d).all()
    assert (digests(pa.array(values, pa.large_string())) == d).all()
    assert (digests(pa.array(values).dictionary_encode()) == d).all()
    # Integers count in decimal (7 and "7" are one id), and row positions too.
    assert digests(pa.array([7]))[0] == d[-1]
    assert (position_digests(5, 3) == digests(pa.array(["5", "6", "7"]))).all()
    # Ids of one length take a faster path: it gives what a batch of mixed lengths gives.
    same_length = [f"img-{i:08d}" for i in range(50)]
    assert (digests(pa.array(same_length)) == digests(pa.array([*same_length, "x"]))[:50]).all()
    # Nulls are spread out (never one repeated digest), and the width can be cut.
    nulls = digests(pa.array([None, None, "a"]))
    assert nulls[0] != nulls[1]
    assert (digests(pa.array(values), bits=4) < 16).all()


def test_many_distinct_ids_have_distinct_digests():
    ids = pa.array([f"row-{i}" for i in range(200_000)])
    assert len(np.unique(digests(ids))) == len(ids)


@pytest.mark.parametrize("bits", [64, 3])
def test_forced_collisions_report_exactly_the_real_duplicates(tmp_path: Path, bits: int):
    # 3-bit digests: 8 values for ~300 ids, so nearly every row collides with many others;
    # only the real duplicates ("b-7" twice, and position 3 of the id-less file vs "3") remain.
    _write(tmp_path / "in" / "a.parquet", [f"a-{i}" for i in range(120)] + ["3"])
    _write(tmp_path / "in" / "b.parquet", [f"b-{i}" for i in range(100)] + ["b-7"])
    _write(tmp_path / "in" / "c.parquet", None, n=60)  # ids are input positions 222..281
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(str(tmp_path / "in")), CONFIG, digest_bits=bits)
    errors = raised.value.errors
    assert raised.value.total == 1, str(raised.value)
    (err,) = errors
    assert err.file.endswith("b.parquet") and err.row == 100 and err.column == "id"
    assert f"{tmp_path / 'in' / 'b.parquet'} row 7" in err.message


def test_collisions_without_duplicates_pass(tmp_path: Path):
    for f in range(3):
        _write(tmp_path / "in" / f"{f}.parquet", [f"f{f}-{i}" for i in range(90)])
    plan = plan_job(PromptSource(str(tmp_path / "in")), CONFIG, digest_bits=2)
    assert plan.total_rows == 270
    # Shards are numbered through the files in order, whichever thread cut them.
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    assert [s.file.rsplit("/", 1)[-1] for s in plan.shards] == sorted(
        s.file.rsplit("/", 1)[-1] for s in plan.shards
    )


def test_position_ids_collide_with_given_ids_across_files(tmp_path: Path):
    _write(tmp_path / "in" / "a.parquet", None, n=5)  # ids "0".."4"
    _write(tmp_path / "in" / "b.parquet", ["q", "4", "2"])
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(str(tmp_path / "in")), CONFIG, digest_bits=1)
    assert raised.value.total == 2
    assert [e.row for e in raised.value.errors] == [1, 2]
    assert all("a file without an id column" in e.message for e in raised.value.errors)


def test_all_duplicates_are_counted_and_the_first_ones_shown(tmp_path: Path):
    _write(tmp_path / "in" / "a.parquet", [f"x{i % 10}" for i in range(200)])
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(str(tmp_path / "in")), PlanConfig(rows=CONFIG.rows, max_errors=5))
    assert raised.value.total == 190
    assert [e.row for e in raised.value.errors] == [10, 11, 12, 13, 14]
    assert "row 0" in raised.value.errors[0].message


def test_digest_memory_is_eight_bytes_per_row():
    dups = DuplicateIds(1_000_000)
    assert dups._digests.nbytes == 8_000_000


@pytest.mark.parametrize("bad", ["unreadable", "other schema"])
def test_a_bad_file_among_many_is_named_before_any_row_is_read(tmp_path: Path, monkeypatch, bad: str):
    for f in range(12):
        _write(tmp_path / "in" / f"part-{f:02d}.parquet", [f"{f}-{i}" for i in range(20)])
    target = tmp_path / "in" / "part-07.parquet"
    if bad == "unreadable":
        target.write_bytes(b"PAR1 truncated")
    else:
        pq.write_table(pa.table({"caption": ["a cat"], "id": [1.5]}), target)
    batches = []
    real = scan_module.iter_batches
    monkeypatch.setattr(scan_module, "iter_batches", lambda *a, **k: batches.append(1) or real(*a, **k))
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(str(tmp_path / "in")), CONFIG)
    assert not batches, "rows were read before the bad file was named"
    text = str(raised.value)
    assert "part-07.parquet" in text
    assert ("not a Parquet file" in text) if bad == "unreadable" else ("no 'prompt' column" in text)
