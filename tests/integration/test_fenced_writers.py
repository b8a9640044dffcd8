"""Issue 32, scenarios 1-4 and 9, and issue 48's paused compaction (10): drivers, `verify --clean` and stragglers as real processes,
stopped at the pause points of INTEGRITY.md section 8 (SIGSTOP, then SIGCONT or SIGKILL), on a
local folder and on S3 at the moto loopback endpoint.

Each process is tests/support/fence_entry.py: a driver (the real run_job; its shards run in the
driver process on a stand-in worker that stores real files, parquet data files and tars), a lone
shard run (a twin or a straggler whose driver is gone), or the `ditfleet` CLI. The output is the
"parquet" format, 3 shards of 2 rows, so a row twice in data/ is seen by a reader of data/.

What is checked at the end, as INTEGRITY.md defines it: every reader that globs manifests/ or
data/ sees each row exactly once and no row names a missing object; a superseded generation's key
holds a tombstone, its rows and objects are kept under `_superseded/`; an abandoned redo
generation holds a seal; `_SUCCESS` was written under the highest lease generation; `ditfleet
verify` exits 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.compact import COMPACTED_KEY, compacted_state
from ditfleet.driver.output.verify import verify_output
from ditfleet.workers.output.layout import lease_key, manifest_key, success_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import ObjectStore, S3Config, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.format_worker import HOLD_BEFORE_COMMIT, STOP_BEFORE_COMMIT
from tests.support.output_checks import (
    assert_readers_see_each_row_once,
    assert_sealed,
    assert_success_current,
    assert_superseded,
    lease_generations,
    manifest_file,
    missing_named,
    snapshot,
)
from tests.support.paused_process import Finished, Processes
from tests.support.worker_fixtures import write_prompts

ROWS, SHARD_SIZE, FORMAT = 6, 2, "parquet"
IDS = [f"p{i:05d}" for i in range(ROWS)]


@dataclass
class Case:
    uri: str
    store: ObjectStore
    procs: Processes
    prompts: Path
    cli: list[str]  # the CLI's S3 flags


@pytest.fixture(params=["local", "s3"])
def case(request, tmp_path):
    prompts = write_prompts(tmp_path / "in" / "prompts.parquet", ROWS)
    if request.param == "local":
        uri, s3, endpoint, cli = str(tmp_path / "out"), S3Config(), None, []
    else:
        server = request.getfixturevalue("s3_server")
        uri = f"s3://{request.getfixturevalue('s3_bucket')}/out"
        s3, endpoint = server.config(), server.endpoint_url
        cli = ["--endpoint-url", endpoint, "--region", s3.region]
    base = {
        "input": str(prompts),
        "output": uri,
        "endpoint_url": endpoint,
        "format": FORMAT,
        "shard_size": SHARD_SIZE,
    }
    procs = Processes(tmp_path / "procs", base)
    try:
        yield Case(uri, open_store(uri, s3), procs, prompts, cli)
    finally:
        procs.close()


def lapse_lease(store: ObjectStore) -> None:
    """The highest lease document as its stopped holder leaves it once its time is up: expired.
    The test moves the expiry to the past rather than waiting the lease out, so no test depends on
    how fast the machine runs (a holder that is not stopped keeps the default 120 s lease)."""
    key = lease_key(max(lease_generations(store)))
    doc = json.loads(store.get(key))
    assert not doc["released"], doc
    store.put(key, json.dumps({**doc, "expires_at": time.time() - 1}).encode(), "application/json")


def finished(case: Case) -> None:
    """A complete output, made by a driver process with no pause."""
    done = case.procs.run("base")
    assert done.rc == 0, done


def killed_twin(case: Case, shard: int, **spec) -> str:
    """A twin run of `shard` (attempt 1, started before the shard was committed) that stored its
    data file and was killed before its commit; returns that file's key (provably lost once the
    shard is committed by another run)."""
    twin = case.procs.start(
        "twin",
        mode="worker",
        shard=shard,
        attempt=1,
        pause_shards=[shard],
        checked_before_commit=True,
        pause_at=[STOP_BEFORE_COMMIT],
        **spec,
    )
    twin.wait_paused(STOP_BEFORE_COMMIT)
    twin.kill()
    left = [k for k in case.store.list("data/") if k.startswith(f"data/shard-{shard:05d}-a1-")]
    assert len(left) == 1, left
    return left[0]


def assert_redo_kept(case: Case, redo: Finished) -> None:
    """The redo of shard 1 exited 0, its manifest (generation 1) is committed, and every object
    it names is there."""
    assert redo.rc == 0, redo
    assert manifest_file(case.store, manifest_key(1, 1)).rows, "the redo of shard 1 is not committed"
    lost = missing_named(case.store, manifest_key(1, 1))
    assert not lost, f"objects of the committed redo of shard 1 were deleted: {lost}"


def assert_intact(case: Case) -> None:
    """The end state every scenario must leave: readers see each row once, nothing named is
    missing, `_SUCCESS` is current, verify finds nothing wrong."""
    assert_readers_see_each_row_once(case.store, IDS, FORMAT)
    report = verify_output(case.store)
    assert report.exit_code == 0, report.format_text()
    assert_success_current(case.store)


# -- 1. a driver paused past its lease deletes nothing another driver committed ------------------


def test_1_driver_paused_in_cleanup_past_its_lease_deletes_nothing_of_a_redo(case):
    lost = killed_twin(case, 1)  # A's clean-up has this to delete once A committed shard 1
    a = case.procs.start("A", pause_at=["in_cleanup"])
    a.wait_paused("in_cleanup")  # A committed every shard, read the manifests, found the twin's file lost
    lapse_lease(case.store)
    b = case.procs.run("B-redo", redo=[1])
    assert b.rc == 0 and case.store.exists(success_key()), b
    a.cont()
    a_done = a.finish()
    assert_redo_kept(case, b)
    assert not case.store.exists(lost)
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)
    assert a_done.rc != 0, f"A, which lost the output while paused, must not finish it: {a_done}"


def test_1_driver_paused_after_its_lease_check_deletes_nothing_of_a_redo(case):
    a = case.procs.start("A", pause_at=["after_lease_check"])
    a.wait_paused("after_lease_check")
    lapse_lease(case.store)
    # B takes the output over and redoes shard 1: its objects are stored, its commit waits.
    b = case.procs.start("B-redo", redo=[1], pause_shards=[1], pause_at=[HOLD_BEFORE_COMMIT])
    b.wait_held(HOLD_BEFORE_COMMIT)
    a.cont()  # A's clean-up runs now, against B's stored but uncommitted objects
    a_done = a.finish()
    b.release(HOLD_BEFORE_COMMIT)
    b_done = b.finish()
    assert_redo_kept(case, b_done)
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)
    assert a_done.rc != 0, a_done


def test_1_driver_paused_before_success_past_its_lease_cannot_finish_the_output(case):
    a = case.procs.start("A", pause_at=["before_success"])
    a.wait_paused("before_success")  # A's clean-up is done; its _SUCCESS is next
    lapse_lease(case.store)
    b = case.procs.start("B-redo", redo=[1], pause_shards=[1], pause_at=[HOLD_BEFORE_COMMIT])
    b.wait_held(HOLD_BEFORE_COMMIT)  # B owns the output; shard 1's redo is not committed
    a.cont()
    a_done = a.finish()
    # Whatever A wrote, no tool takes the output for finished while B's redo is under way.
    status = case.procs.run("status", mode="cli", argv=["status", case.uri, "--json", *case.cli])
    assert json.loads(status.out)["complete"] is False, f"A's _SUCCESS is believed: {status}\n{a_done}"
    assert status.rc != 0
    b.release(HOLD_BEFORE_COMMIT)
    assert_redo_kept(case, b.finish())
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)


# -- 2. verify --clean paused past its lease deletes nothing of a redo ----------------------------


def test_2_verify_clean_paused_before_deleting_deletes_nothing_of_a_redo(case):
    finished(case)
    lost = killed_twin(case, 1)  # what verify --clean has to delete: a killed twin's data file
    v = case.procs.start(
        "verify-clean",
        mode="cli",
        argv=["verify", case.uri, "--clean", *case.cli],
        pause_at=["verify_before_delete"],
    )
    v.wait_paused("verify_before_delete")  # it read the manifests of generation 0
    lapse_lease(case.store)
    b = case.procs.run("B-redo", redo=[1])
    assert b.rc == 0, b
    v.cont()
    v.finish()
    assert_redo_kept(case, b)
    assert not case.store.exists(lost)
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)


# -- 3. a crash before the clean-up, then a plain rerun: no row twice under _SUCCESS -------------


def test_3_redo_killed_after_its_commit_then_a_rerun_leaves_each_row_once(case):
    finished(case)
    a = case.procs.start("A-redo", redo=[1], pause_at=["after_redo_commit"])
    a.wait_paused("after_redo_commit")  # generation 1 of shard 1 is committed, nothing superseded yet
    a.kill()
    assert case.store.exists(manifest_key(1, 1))
    b = case.procs.run("B-rerun")
    assert b.rc == 0, b
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)


def test_3_driver_killed_before_its_cleanup_of_a_killed_twin_then_a_rerun_cleans_it(case):
    lost = killed_twin(case, 1)  # stored its data file, killed before it committed
    # The driver commits every shard (shard 1 by attempt 0) and is killed before its clean-up.
    a = case.procs.start("A", pause_at=["after_lease_check"])
    a.wait_paused("after_lease_check")
    a.kill()
    b = case.procs.run("B-rerun")
    assert b.rc == 0, b
    assert not case.store.exists(lost), f"the killed twin's {lost} is still in data/ under _SUCCESS"
    assert_intact(case)


# -- 4. a straggler of a dead redo can never commit its generation later -------------------------


def test_4_straggler_of_a_dead_redo_cannot_commit_after_the_rerun_and_clean(case):
    finished(case)
    a = case.procs.start("A-redo", redo=[1], pause_at=["after_dispatch_start"])
    a.wait_paused("after_dispatch_start")  # its lease document names the redo of shard 1, generation 1
    # A's actor for shard 1: it stores generation 1's objects and stops before committing.
    straggler = case.procs.start(
        "straggler", mode="worker", shard=1, generation=1, pause_shards=[1], pause_at=[STOP_BEFORE_COMMIT]
    )
    straggler.wait_paused(STOP_BEFORE_COMMIT)
    a.kill()  # the redo's driver dies; its straggler lives on
    b = case.procs.run("B-rerun")
    assert b.rc == 0, b
    clean = case.procs.run("verify-clean", mode="cli", argv=["verify", case.uri, "--clean", *case.cli])
    assert clean.rc == 0, clean
    straggler.cont()  # it tries to commit generation 1 now
    s_done = straggler.finish()
    assert s_done.rc == 0, s_done
    assert_intact(case)
    assert_sealed(case.store, 1, 1)
    assert json.loads(s_done.out.strip().splitlines()[-1])["status"] == "already_committed", s_done


def test_4_straggler_of_a_dead_redo_that_commits_first_is_superseding(case):
    finished(case)
    a = case.procs.start("A-redo", redo=[1], pause_at=["after_dispatch_start"])
    a.wait_paused("after_dispatch_start")
    straggler = case.procs.start(
        "straggler", mode="worker", shard=1, generation=1, pause_shards=[1], pause_at=[STOP_BEFORE_COMMIT]
    )
    straggler.wait_paused(STOP_BEFORE_COMMIT)
    a.kill()
    straggler.cont()  # it commits generation 1 before any other driver settles A's redo
    s_done = straggler.finish()
    assert json.loads(s_done.out.strip().splitlines()[-1])["status"] == "committed", s_done
    b = case.procs.run("B-rerun")
    assert b.rc == 0, b
    assert_intact(case)
    assert_superseded(case.store, 1, 0, by=1)  # the straggler's commit is real: it supersedes


# -- 9. an incremental run refused the lease has changed nothing ---------------------------------


def _write_day(folder: Path, name: str, ids: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": ids, "prompt": [f"a small red circle number {i}" for i in ids]})
    pq.write_table(table, folder / f".{name}")
    (folder / f".{name}").rename(folder / name)


def test_9_incremental_run_refused_the_lease_changes_nothing(case, tmp_path):
    days = tmp_path / "days"
    _write_day(days, "2024-06-01.parquet", ["a0", "a1", "a2", "a3"])
    inc = {"input": str(days), "incremental": True}
    first = case.procs.run("run-1", **inc)
    assert first.rc == 0 and case.store.exists(success_key()), first
    lost = killed_twin(case, 0, **inc)
    # verify --clean, about to delete the twin's file, holds the output's lease (a live holder:
    # the default lease length).
    holder = case.procs.start(
        "verify-clean",
        mode="cli",
        argv=["verify", case.uri, "--clean", *case.cli],
        pause_at=["verify_before_delete"],
    )
    holder.wait_paused("verify_before_delete")
    before = snapshot(case.store)
    _write_day(days, "2024-06-02.parquet", ["b0", "b1", "b2"])
    refused = case.procs.run("run-2-refused", **inc)
    assert refused.rc != 0 and "OutputBusy" in refused.err, refused
    after = snapshot(case.store)
    assert after == before, {
        "added": sorted(set(after) - set(before)),
        "removed": sorted(set(before) - set(after)),
        "changed": sorted(k for k in set(after) & set(before) if after[k] != before[k]),
    }
    holder.cont()
    assert holder.finish().rc == 0 and not case.store.exists(lost)
    second = case.procs.run("run-2", **inc)
    assert second.rc == 0, second
    assert_readers_see_each_row_once(case.store, ["a0", "a1", "a2", "a3", "b0", "b1", "b2"], FORMAT)
    assert verify_output(case.store).exit_code == 0


@pytest.mark.parametrize("had_set", [True, False], ids=["over-a-set", "no-set-before"])
def test_10_compaction_paused_after_its_lease_check_writes_nothing_over_a_redo(case, had_set):
    # Issue 48, item 3, on a local folder and on S3: a `ditfleet compact` stopped right after its
    # lease check, its lease run out, a redo of shard 1 that finishes (`_SUCCESS`), then the
    # compaction going on. Its set, made from the manifests before the redo, is written only over
    # the version of the set it read before them (S3 If-Match / If-None-Match), which the redo's
    # finish changed: the compacted set stays the union of the current manifests.
    finished(case)
    if had_set:
        assert (
            done := case.procs.run("compact", mode="cli", argv=["compact", case.uri, *case.cli])
        ).rc == 0, done
    late = case.procs.start(
        "late-compact",
        mode="cli",
        argv=["compact", case.uri, *case.cli],
        pause_at=["compact_after_lease_check"],
    )
    late.wait_paused("compact_after_lease_check")
    lapse_lease(case.store)
    assert (done := case.procs.run("redo", redo=[1])).rc == 0, done
    late.cont()
    refused = late.finish()
    compacted = read_parquet(case.store.get(COMPACTED_KEY)).select(["id", "uri"]).to_pylist()
    current = read_manifests(case.store).select(["id", "uri"]).to_pylist()
    assert sorted(compacted, key=str) == sorted(current, key=str), (compacted, current)
    assert refused.rc == 2 and "was written by another writer while this compaction ran" in refused.err, (
        refused
    )
    assert compacted_state(case.store).current
