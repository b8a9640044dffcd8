"""Issue 48 items 1 and 5 on a local folder, without processes: `_superseded/` is history that no
rule reads (a tombstone lists its generation's objects), a supersession stopped at any step and
then stripped of its history is finished, an old tombstone whose copy is gone blocks nothing,
and `_SUCCESS` is removed only under a current lease and never when a later generation wrote it.
The paused and killed processes of the same cases are tests/integration/test_fenced_writers.py's
(`test_48_...`)."""

from __future__ import annotations

import io
import json
import shutil

import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.lease import OutputBusy, acquire_lease
from ditfleet.driver.output.orphans import delete_lost, shard_records
from ditfleet.driver.output.success import put_success, remove_success, success_file
from ditfleet.driver.output.supersede import supersede_pending
from ditfleet.workers.output.layout import manifest_key, new_attempt_token, success_key, superseded_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, SUPERSEDED, manifest_kind, read_manifests
from ditfleet.workers.storage import LocalStore
from tests.unit.driver.test_integrity_rules import _redone_output, commit, crashed_supersessions, straggler


def _rows_once(store) -> None:
    ids = sorted(read_manifests(store).column("id").to_pylist())
    assert ids == ["p0", "p0", "p1", "p1"], ids


def test_a_second_redo_after_superseded_was_deleted_supersedes_from_its_own_manifest(tmp_path):
    root = tmp_path / "out"
    store, old, first_redo = _redone_output(root)
    assert supersede_pending(store).generations == [(0, 0)]
    shutil.rmtree(root / "_superseded")  # as docs/reliability.md allows, or a lifecycle rule
    second_redo = commit(store, 0, 2, new_attempt_token(0, 2))
    lost = straggler(store, 0, 2)  # a losing run of the second redo
    done = supersede_pending(store)
    assert done.generations == [(0, 1)] and not done.blocked, done
    assert manifest_kind(store.get(manifest_key(0, 1))).kind == SUPERSEDED
    assert all(store.exists(superseded_key(k)) and not store.exists(k) for k in first_redo)
    _rows_once(store)
    # The one rule still reads every generation: the lost straggler goes, nothing else does.
    assert shard_records(store, [0])[0].accounted
    assert delete_lost(store, [0]) == 1 and not store.exists(lost)
    assert sorted(store.list("images/00000/")) == sorted(second_redo)


def test_a_supersession_stopped_at_any_step_is_finished_after_its_history_is_deleted(tmp_path):
    for steps, root, store, old, new, other, _ in crashed_supersessions(tmp_path):
        shutil.rmtree(root / "_superseded", ignore_errors=True)
        done = supersede_pending(LocalStore(str(root)))
        assert not done.blocked, (steps, done.blocked)
        assert set(store.list("images/")) == set(new) | set(other), steps
        # Whatever the step, the tombstone lists generation 0's objects: none is left behind.
        assert manifest_kind(store.get(manifest_key(0))).objects == tuple(sorted(old)), steps
        _rows_once(store)
    assert steps > 3


def _old_tombstone(by: int) -> bytes:
    """A tombstone as the version before issue 48 wrote it: no list of its objects."""
    metadata = {
        **MANIFEST_SCHEMA.metadata,
        b"ditfleet.tombstone": b"superseded",
        b"ditfleet.superseded_by": str(by).encode(),
    }
    buf = io.BytesIO()
    pq.write_table(MANIFEST_SCHEMA.with_metadata(metadata).empty_table(), buf)
    return buf.getvalue()


def test_an_old_tombstone_whose_copy_is_gone_blocks_nothing_and_its_leftovers_are_kept(tmp_path):
    root = tmp_path / "out"
    store, old, new = _redone_output(root)
    # An old version's supersession stopped between its tombstone and deleting the sources;
    # then `_superseded/` was deleted.
    store.put(manifest_key(0), _old_tombstone(1))
    lost = straggler(store, 0, 1)  # a losing run of generation 1: provably lost
    record = shard_records(store, [0])[0]
    assert record.accounted and record.history_gone == {0}
    assert not record.is_lost(old[0])  # nothing says what generation 0 named: not provably lost
    assert record.is_lost(lost)
    done = supersede_pending(store)
    assert done.generations == [(0, 0)] and not done.blocked, done
    assert all(not store.exists(k) and store.exists(superseded_key(k)) for k in old)  # kept, not deleted
    assert delete_lost(store, [0]) == 1
    assert sorted(store.list("images/00000/")) == sorted(new)


def test_an_unreadable_lower_manifest_blocks_success_naming_it(tmp_path):
    root = tmp_path / "out"
    store, old, new = _redone_output(root)
    store.put(manifest_key(0), b"not parquet")
    done = supersede_pending(store)
    assert done.generations == [] and len(done.blocked) == 1
    assert store.uri(manifest_key(0)) in done.blocked[0] and "cannot be read" in done.blocked[0]


def test_success_is_removed_only_under_a_current_lease_and_a_later_generations_is_kept(tmp_path):
    store = LocalStore(str(tmp_path / "out"))
    first = acquire_lease(store, renew=False)
    put_success(store, {"status": "ok"}, first.generation)
    first.release()
    a = acquire_lease(store, renew=False, ttl_s=0.0)  # A: its lease runs out at once (a pause)
    b = acquire_lease(store, renew=False)  # B takes the output over and finishes it
    assert remove_success(store, b) and not store.exists(success_key())
    put_success(store, {"status": "ok"}, b.generation)
    with pytest.raises(OutputBusy):
        remove_success(store, a)  # A resumes: it lost the output, it removes nothing
    assert json.loads(store.get(success_key()))["lease"] == b.generation
    assert success_file(store).doc is not None
    # A `_SUCCESS` written under this driver's generation or a later one is never removed.
    assert not remove_success(store, b) and store.exists(success_key())


def test_a_stale_view_never_replaces_a_later_generations_success(tmp_path):
    store = LocalStore(str(tmp_path / "out"))
    put_success(store, {"status": "ok"}, 0)
    put_success(store, {"status": "ok"}, 2)  # a lower generation's is replaced
    assert json.loads(store.get(success_key()))["lease"] == 2
    with pytest.raises(OutputBusy):
        put_success(store, {"status": "ok"}, 1)  # a later one is never replaced
    assert json.loads(store.get(success_key()))["lease"] == 2


def test_verify_names_an_old_tombstones_leftovers_precisely_and_clean_moves_them(tmp_path):
    from ditfleet.driver.output.verify import verify_output

    store = LocalStore(str(tmp_path / "out"))
    old = commit(store, 0, 0, new_attempt_token(0), ids=("a0", "a1"))
    commit(store, 0, 1, new_attempt_token(0, 1), ids=("a0", "a1"))
    commit(store, 1, 0, new_attempt_token(0), ids=("b0", "b1"))
    store.put(manifest_key(0), _old_tombstone(1))  # stopped before deleting; then _superseded/ deleted
    store.put(
        "_job.json", json.dumps({"fingerprint": "t", "plan": {"shards": 2, "rows": 4, "images": 4}}).encode()
    )
    run = acquire_lease(store, ttl_s=60, renew=False)
    put_success(store, {"status": "succeeded", "images": {"ok": 4, "failed": 0}}, run.generation)
    run.mark_settled()
    run.release()
    report = verify_output(store)
    assert report.exit_code == 1 and report.pending == 0, report.format_text()
    [line] = [p for p in report.problems if "generation 0 is superseded by generation 1" in p]
    assert "copy under _superseded/ was deleted" in line and "verify --clean" in line, line
    assert any(store.uri(k) in line for k in old), line
    cleaned = verify_output(store, clean=True)
    assert cleaned.superseded == 1 and cleaned.exit_code == 0, cleaned.format_text()
    assert all(not store.exists(k) and store.exists(superseded_key(k)) for k in old)
    assert verify_output(store).exit_code == 0
