"""Issue 32, scenario 6: the compacted set (`ditfleet compact`) is never silently stale and never a
mix, as real processes see it.

- After compact then a redo, the compacted set that readers take (`compacted/*.parquet` with
  pyarrow.dataset and DuckDB) is the union of the current manifests: the redo's finish rebuilt
  it, so no compacted row names a superseded (moved) object, and `ditfleet status` says current.
- A second compaction with other settings, killed (SIGKILL) before it writes or between its set
  and its index, leaves the old set or the new one, each row once; status says whether it is
  current; compacting again mends it.
- Compaction is a writer: while a driver owns the output it is refused, and writes nothing.

Drivers and the CLI are processes of tests/support/fence_entry.py (the stand-in worker that
stores real data files), paused at the seam of driver/output/pause_points.py.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from ditfleet.driver.output.compact import (
    COMPACTED_KEY,
    SPILL_PREFIX,
    compacted_state,
    remove_abandoned_spills,
)
from ditfleet.workers.output.formats import object_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.integration.test_fenced_writers import lapse_lease
from tests.support.paused_process import Processes
from tests.support.worker_fixtures import write_prompts

ROWS, SHARD_SIZE = 6, 2
IDS = [f"p{i:05d}" for i in range(ROWS)]


@pytest.fixture
def output(tmp_path):
    """A finished parquet-format output of 3 shards, compacted once; its process helper."""
    prompts = write_prompts(tmp_path / "prompts.parquet", ROWS)
    out = tmp_path / "out"
    procs = Processes(
        tmp_path / "procs",
        {"input": str(prompts), "output": str(out), "format": "parquet", "shard_size": SHARD_SIZE},
    )
    try:
        assert (done := procs.run("run")).rc == 0, done
        assert (done := compact(procs, out)).rc == 0, done
        yield out, procs
    finally:
        procs.close()


def compact(procs: Processes, out: Path, *extra: str, **start):
    return procs.run("compact", mode="cli", argv=["compact", str(out), *extra], **start)


def compacted_rows(out: Path) -> list[list[dict]]:
    """The compacted set's (id, uri, sha256) rows as pyarrow.dataset and DuckDB read them."""
    import duckdb
    import pyarrow.dataset as ds

    columns = ["id", "status", "uri", "sha256"]
    arrow = ds.dataset(f"{out}/compacted", format="parquet").to_table(columns=columns).to_pylist()
    with duckdb.connect() as con:
        result = con.execute(f"SELECT id, status, uri, sha256 FROM read_parquet('{out}/compacted/*.parquet')")
        duck = [dict(zip(columns, r)) for r in result.fetchall()]
    return [arrow, duck]


def assert_each_row_once_naming_what_is_there(out: Path, rows: list[dict]) -> None:
    seen = Counter(r["id"] for r in rows)
    assert sorted(seen) == IDS and set(seen.values()) == {1}, seen
    gone = [
        r["uri"]
        for r in rows
        if r["status"] == "ok" and not (out / object_key(str(out), r["uri"])[0]).exists()
    ]
    assert not gone, f"compacted rows name objects that are not there: {gone}"


def status(procs: Processes, out: Path) -> dict:
    done = procs.run("status", mode="cli", argv=["status", str(out), "--json"])
    assert done.rc == 0, done
    return json.loads(done.out)


def test_a_redo_after_compaction_leaves_the_compacted_set_current(output):
    out, procs = output
    before = {r["id"]: r["sha256"] for r in compacted_rows(out)[0]}
    assert (done := procs.run("redo", redo=[1])).rc == 0, done
    assert "rebuilt the compacted set" in done.err
    current = {r["id"]: r for r in read_manifests(open_store(str(out))).to_pylist()}
    for rows in compacted_rows(out):
        assert_each_row_once_naming_what_is_there(out, rows)
        assert {r["id"]: r["uri"] for r in rows} == {i: r["uri"] for i, r in current.items()}
    # The redone shard's rows are the redo's (another attempt's data file), the others unchanged.
    redone = {i for i, r in current.items() if r["shard"] == 1}
    assert redone and all(before[i] == current[i]["sha256"] for i in set(IDS) - redone)
    assert status(procs, out)["compacted"] == "current"


@pytest.mark.parametrize("point", ["compact_before_write", "compact_before_index"])
def test_a_second_compaction_killed_midway_leaves_one_set_never_a_mix(output, point):
    out, procs = output
    old = (out / COMPACTED_KEY).read_bytes()
    # A redo whose finish finds the set stale and rebuilds it; then a compaction with other
    # settings, killed at `point`.
    assert procs.run("redo", redo=[2]).rc == 0
    rebuilt = (out / COMPACTED_KEY).read_bytes()
    assert rebuilt != old
    killed = procs.start(
        "compact", mode="cli", argv=["compact", str(out), "--row-group-rows", "1"], pause_at=[point]
    )
    killed.wait_paused(point)
    killed.kill()
    after = (out / COMPACTED_KEY).read_bytes()
    assert after == rebuilt if point == "compact_before_write" else after != rebuilt
    for rows in compacted_rows(out):
        assert_each_row_once_naming_what_is_there(out, rows)
    assert not [k for k in os.listdir(out / "compacted") if k not in ("manifests.parquet", "_index.json")]
    # Made from the same manifests, the set is current either way, and the output stays finished
    # (a compaction's lease keeps a complete output complete); compacting again mends the index.
    assert compacted_state(open_store(str(out))).current
    assert status(procs, out)["complete"]
    assert (done := compact(procs, out)).rc == 0, done
    got = status(procs, out)
    assert got["compacted"] == "current" and got["complete"], got


def test_compaction_is_refused_while_a_driver_owns_the_output(output):
    out, procs = output
    index = (out / "compacted" / "_index.json").read_bytes()
    driver = procs.start("redo", redo=[0], pause_at=["after_dispatch_start"])
    driver.wait_paused("after_dispatch_start")
    try:
        refused = compact(procs, out)
        assert refused.rc == 2 and "being written by another" in refused.err, refused
        assert (out / "compacted" / "_index.json").read_bytes() == index
    finally:
        driver.cont()
    assert driver.finish().rc == 0
    for rows in compacted_rows(out):
        assert_each_row_once_naming_what_is_there(out, rows)


def current_uris(out: Path) -> dict[str, str]:
    return {r["id"]: r["uri"] for r in read_manifests(open_store(str(out))).to_pylist()}


@pytest.mark.parametrize("had_set", [True, False], ids=["over-a-set", "no-set-before"])
def test_a_compaction_paused_after_its_lease_check_never_shows_readers_a_superseded_row(output, had_set):
    # Issue 48, item 3: a `ditfleet compact` stopped right after its lease check, its lease run out,
    # a redo of shard 1 taking the output and finishing (`_SUCCESS`), then the compaction going on.
    # Before the fence it wrote its set, made from the manifests before the redo, after the redo's
    # `_SUCCESS`: status and verify called it stale, but readers of compacted/ got the superseded
    # row. Now it writes only over the set it found (absent: only while none is there); the redo's
    # finish rebuilt that set (or, with none there, built one, since the compaction it took the
    # output from never released it), so the late writer writes nothing and says why.
    out, procs = output
    if not had_set:
        for name in os.listdir(out / "compacted"):
            os.remove(out / "compacted" / name)
        os.rmdir(out / "compacted")
    late = procs.start(
        "compact", mode="cli", argv=["compact", str(out)], pause_at=["compact_after_lease_check"]
    )
    late.wait_paused("compact_after_lease_check")
    lapse_lease(open_store(str(out)))
    assert (done := procs.run("redo", redo=[1])).rc == 0, done
    assert "rebuilt the compacted set" in done.err, done
    late.cont()
    refused = late.finish()
    for rows in compacted_rows(out):
        assert_each_row_once_naming_what_is_there(out, rows)
        assert {r["id"]: r["uri"] for r in rows} == current_uris(out)
    assert refused.rc == 2 and "was written by another writer while this compaction ran" in refused.err, (
        refused
    )
    got = status(procs, out)
    assert got["compacted"] == "current" and got["complete"], got


def test_a_killed_compactions_spill_directory_is_removed_by_the_next_one(output, tmp_path):
    # Also seen in issue 48: every killed compaction left its spill directory (a full copy of the
    # manifests) in the temporary folder. A killed one cannot clean up after itself; the next
    # compaction on the machine removes the directories whose owner process is gone, and only those.
    out, procs = output
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    killed = procs.start(
        "compact",
        mode="cli",
        argv=["compact", str(out)],
        pause_at=["compact_before_write"],
        env={"TMPDIR": str(tmp)},
    )
    killed.wait_paused("compact_before_write")
    spills = [p for p in tmp.iterdir() if p.name.startswith(SPILL_PREFIX)]
    assert len(spills) == 1 and (spills[0] / "manifests.parquet").exists(), spills
    assert remove_abandoned_spills(str(tmp)) == [] and spills[0].exists()  # its owner is alive: kept
    killed.kill()
    assert (done := compact(procs, out, env={"TMPDIR": str(tmp)})).rc == 0, done
    assert not list(tmp.iterdir()), list(tmp.iterdir())
