"""The integrity rules of issue 32 on a local folder, without processes: the generation in the
token, tombstones and seals, the one deletion rule (also on a stale view), supersession crashed
at every step, settling older lease documents, and a stale `_SUCCESS`. The paused, killed
processes of the same scenarios are tests/integration's."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest

from ditfleet.driver.output.lease import acquire_lease, shard_ranges, shards_of_ranges
from ditfleet.driver.output.orphans import delete_lost, shard_lost_objects, shard_records
from ditfleet.driver.output.settle import settle_older
from ditfleet.driver.output.success import SuccessStale, put_success, success_file
from ditfleet.driver.output.supersede import supersede_pending
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats import attempt_object
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token, superseded_key, token_generation
from ditfleet.workers.output.manifest import (
    MANIFEST,
    MANIFEST_SCHEMA,
    SEALED,
    SUPERSEDED,
    ManifestKind,
    ManifestWriter,
    committed_shards,
    current_manifest_keys,
    manifest_kind,
    read_manifests,
    seal_bytes,
    tombstone_bytes,
)
from ditfleet.workers.storage import LocalStore, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet


def commit(store, shard: int, generation: int, token: str, ids=("p0", "p1")) -> list[str]:
    """Store one image per id under `token` and commit generation `generation` naming them."""
    writer = ManifestWriter(shard, generation=generation)
    keys = []
    for row_id in ids:
        key = image_key(shard, token, row_id, None, "png")
        writer.add(manifest_row(row_id, shard, put_image(store, key, f"{token} {row_id}".encode())))
        keys.append(key)
    assert writer.commit(store)
    return keys


def straggler(store, shard: int, generation: int) -> str:
    """An object of a run of (shard, generation) that has not committed (or lost)."""
    key = image_key(shard, new_attempt_token(1, generation), "p0", None, "png")
    store.put(key, b"straggler")
    return key


# -- the token -------------------------------------------------------------------------------------


def test_the_token_says_its_generation_and_plain_tokens_are_generation_0():
    plain, redo = new_attempt_token(3), new_attempt_token(3, 2)
    assert plain.startswith("a3-") and redo.startswith("r2-a3-")
    assert token_generation(plain) == 0 and token_generation(redo) == 2
    obj = attempt_object(image_key(7, redo, "x", None, "png"))
    assert (obj.shard, obj.attempt, obj.generation) == (7, redo, 2)
    assert attempt_object(f"data/shard-00007-{plain}.parquet").generation == 0
    for bad in ("r0-a1-0123456789abcdef", "r-a1-0123456789abcdef", "a1-0123"):
        with pytest.raises(ValueError):
            image_key(0, bad, "x", None, "png")
    with pytest.raises(ValueError):
        new_attempt_token(0, -1)


# -- tombstones and seals --------------------------------------------------------------------------


def test_tombstones_and_seals_are_zero_row_manifests_that_say_what_they_are(tmp_path):
    for data, kind in (
        (tombstone_bytes(3), ManifestKind(SUPERSEDED, 3)),
        (seal_bytes(), ManifestKind(SEALED)),
    ):
        assert manifest_kind(data) == kind
        table = read_parquet(data)
        assert table.num_rows == 0 and table.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    store = open_store(str(tmp_path / "out"))
    commit(store, 0, 0, new_attempt_token(0))
    assert manifest_kind(store.get(manifest_key(0))) == ManifestKind(MANIFEST)
    # pyarrow.dataset over manifests/ reads nothing from either marker.
    store.put(manifest_key(0, 1), seal_bytes())
    store.put(manifest_key(5), tombstone_bytes(1))
    assert ds.dataset(str(tmp_path / "out" / "manifests"), format="parquet").to_table().num_rows == 2


def test_current_manifest_keys_skip_seals_and_read_only_redo_footers(tmp_path):
    store = open_store(str(tmp_path / "out"))
    commit(store, 0, 0, new_attempt_token(0))
    commit(store, 1, 0, new_attempt_token(0))
    store.put(manifest_key(1, 1), seal_bytes())  # an abandoned redo: shard 1 stays at 0
    commit(store, 2, 0, new_attempt_token(0))
    commit(store, 2, 1, new_attempt_token(0, 1))
    store.put(manifest_key(2, 2), seal_bytes())
    assert current_manifest_keys(store) == {0: manifest_key(0), 1: manifest_key(1), 2: manifest_key(2, 1)}
    assert committed_shards(store) == {0, 1, 2}
    store.put(manifest_key(2), tombstone_bytes(1))  # superseded: readers read generation 1 alone
    assert read_manifests(store).num_rows == 6


# -- the one deletion rule -------------------------------------------------------------------------


def test_only_objects_a_committed_record_proves_lost_are_deleted(tmp_path):
    store = open_store(str(tmp_path / "out"))
    named = commit(store, 0, 0, new_attempt_token(0))
    loser = straggler(store, 0, 0)  # generation 0 is committed and does not name it: lost
    in_play = straggler(store, 0, 1)  # generation 1 has no manifest key: in play
    uncommitted = straggler(store, 1, 0)  # shard 1 has no manifest at all
    assert delete_lost(store) == 1
    assert not store.exists(loser)
    assert all(store.exists(k) for k in [*named, in_play, uncommitted])
    # Sealed: generation 1 can never commit, so its objects are lost.
    store.put(manifest_key(0, 1), seal_bytes())
    assert delete_lost(store, [0]) == 1 and not store.exists(in_play)


def test_a_plain_token_named_by_a_redo_of_an_earlier_version_is_kept(tmp_path):
    # Earlier versions drew plain tokens for redos too: every generation of the shard is read.
    store = open_store(str(tmp_path / "out"))
    commit(store, 0, 0, new_attempt_token(0))
    redo = commit(store, 0, 1, new_attempt_token(1))  # plain token, committed at generation 1
    loser = straggler(store, 0, 0)
    assert delete_lost(store) == 1 and not store.exists(loser)
    assert all(store.exists(k) for k in redo)


def test_a_shard_with_an_unreadable_manifest_loses_nothing(tmp_path):
    store = open_store(str(tmp_path / "out"))
    commit(store, 0, 0, new_attempt_token(0))
    commit(store, 0, 1, new_attempt_token(0, 1))
    store.put(manifest_key(0, 1), store.get(manifest_key(0, 1))[:50])  # cut short
    loser = straggler(store, 0, 0)
    assert delete_lost(store) == 0 and store.exists(loser)


def test_a_paused_deleters_stale_view_cannot_delete_a_newer_generations_commit(tmp_path):
    """Two views of one folder: the deleter reads and judges, then (paused) another driver
    redoes the shard and commits generation 1; the deleter resumes and deletes on its old view."""
    deleter, other = LocalStore(str(tmp_path / "out")), LocalStore(str(tmp_path / "out"))
    commit(other, 0, 0, new_attempt_token(0))
    loser = straggler(other, 0, 0)
    stale = shard_records(deleter)  # read before the pause

    redone: list[str] = []

    def paused_here() -> None:  # the other driver works while the deleter is stopped
        redone.extend(commit(other, 0, 1, new_attempt_token(0, 1)))

    assert delete_lost(deleter, before_delete=paused_here) == 1 and not deleter.exists(loser)
    assert redone and all(other.exists(k) for k in redone)
    # Judged later still on the view read before the redo: its objects are in play for it.
    assert shard_lost_objects(deleter, stale[0]) == []
    assert all(other.exists(k) for k in redone)


# -- supersession ----------------------------------------------------------------------------------


class Crash(Exception):
    pass


class CrashingStore(LocalStore):
    """A local store whose process dies (raises) at its n-th write or delete."""

    def __init__(self, root: str, writes: int) -> None:
        super().__init__(root)
        self.left = writes

    def _tick(self) -> None:
        if self.left == 0:
            raise Crash
        self.left -= 1

    def put(self, *a, **k):
        self._tick()
        return super().put(*a, **k)

    def put_if_absent(self, *a, **k):
        self._tick()
        return super().put_if_absent(*a, **k)

    def copy(self, *a, **k):
        self._tick()
        return super().copy(*a, **k)

    def delete(self, *a, **k):
        self._tick()
        return super().delete(*a, **k)


def _redone_output(root) -> tuple[LocalStore, list[str], list[str]]:
    store = LocalStore(str(root))
    old = commit(store, 0, 0, new_attempt_token(0))
    new = commit(store, 0, 1, new_attempt_token(0, 1))
    commit(store, 1, 0, new_attempt_token(0))
    return store, old, new


def _state(store) -> dict[str, bytes]:
    return {k: store.get(k) for k in sorted(store.list()) if not k.startswith("_lease/")}


def _readers_see_each_row_once_with_its_object(store) -> None:
    rows = read_manifests(store)
    assert sorted(rows.column("id").to_pylist()) == ["p0", "p0", "p1", "p1"]
    for uri in rows.column("uri").to_pylist():
        assert store.exists(uri.removeprefix(store.uri() + "/")), uri


def test_supersession_moves_the_lower_generation_under_superseded_and_is_idempotent(tmp_path):
    store, old, new = _redone_output(tmp_path / "out")
    first = store.get(manifest_key(0))
    done = supersede_pending(store)
    assert done.generations == [(0, 0)] and done.moved == 2 and not done.missing
    assert manifest_kind(store.get(manifest_key(0))) == ManifestKind(SUPERSEDED, 1)
    assert store.get(superseded_key(manifest_key(0))) == first
    assert all(not store.exists(k) and store.exists(superseded_key(k)) for k in old)
    assert all(store.exists(k) for k in new)
    _readers_see_each_row_once_with_its_object(store)
    after = _state(store)
    assert supersede_pending(store).generations == [] and _state(store) == after


def test_supersession_crashed_at_every_step_is_finished_by_the_next_one(tmp_path):
    steps = 0
    while True:
        root = tmp_path / f"crash-{steps}"
        store, old, new = _redone_output(root)
        other = sorted(store.list("images/00001/"))
        first = store.get(manifest_key(0))
        try:
            supersede_pending(CrashingStore(str(root), steps))
            finished = True
        except Crash:
            finished = False
        # At any crash point every object is in the data areas or kept under _superseded/.
        for key in old + new:
            assert store.exists(key) or store.exists(superseded_key(key)), (steps, key)
        supersede_pending(LocalStore(str(root)))
        assert set(store.list("images/")) == set(new) | set(other), steps
        assert set(store.list("_superseded/")) == {superseded_key(manifest_key(0))} | {
            superseded_key(k) for k in old
        }
        assert store.get(superseded_key(manifest_key(0))) == first
        assert manifest_kind(store.get(manifest_key(0))) == ManifestKind(SUPERSEDED, 1)
        _readers_see_each_row_once_with_its_object(store)
        if finished:
            break
        steps += 1
    assert steps >= 6  # 1 manifest copy, 2 object copies, the tombstone, 2 deletions


# -- settling older lease documents ----------------------------------------------------------------


def _older_doc(store, redo: dict[int, int], shards: list[int]) -> None:
    lease = acquire_lease(store, ttl_s=60, renew=False)
    lease.record_work(shards, redo)
    # Crashed: never released, never settled; the next driver takes over once the holder is
    # known gone: here simply a higher generation.


def test_settling_seals_an_abandoned_redo_so_its_straggler_can_never_commit(tmp_path):
    store = open_store(str(tmp_path / "out"))
    commit(store, 3, 0, new_attempt_token(0))
    _older_doc(store, {3: 1}, [3])
    late = straggler(store, 3, 1)
    settled = settle_older(store, 1)  # the next driver's generation
    assert settled.sealed == [(3, 1)] and settled.shards == {3} and settled.documents == [0]
    assert manifest_kind(store.get(manifest_key(3, 1))) == ManifestKind(SEALED)
    # The straggler commits later: refused, its objects are provably lost.
    writer = ManifestWriter(3, generation=1)
    writer.add(manifest_row("p0", 3, put_image(store, late, b"straggler")))
    assert writer.commit(store) is False
    assert current_manifest_keys(store) == {3: manifest_key(3)}
    assert delete_lost(store) == 1 and not store.exists(late)


def test_settling_leaves_a_stragglers_earlier_commit_and_it_is_superseded(tmp_path):
    store = open_store(str(tmp_path / "out"))
    old = commit(store, 3, 0, new_attempt_token(0))
    _older_doc(store, {3: 1}, [3])
    new = commit(store, 3, 1, new_attempt_token(0, 1))  # the straggler won the race
    assert settle_older(store, 1).sealed == []
    assert manifest_kind(store.get(manifest_key(3, 1))) == ManifestKind(MANIFEST)
    assert supersede_pending(store).generations == [(3, 0)]
    assert all(store.exists(superseded_key(k)) and not store.exists(k) for k in old)
    assert all(store.exists(k) for k in new)


def test_a_lease_document_records_its_shards_as_ranges_and_settled_ones_are_skipped(tmp_path):
    assert shard_ranges([5, 0, 1, 2, 7, 6]) == [[0, 2], [5, 7]]
    assert shards_of_ranges(shard_ranges(range(400_000))) == set(range(400_000))
    assert len(json.dumps(shard_ranges(range(400_000)))) < 20
    assert shards_of_ranges(None) is None  # an earlier version's document: every shard
    store = open_store(str(tmp_path / "out"))
    lease = acquire_lease(store, ttl_s=60, renew=False)
    lease.record_work([1, 2], {2: 1})
    lease.mark_settled()
    lease.release()
    assert settle_older(store, 1).shards == set()  # settled: nothing to seal or clean


# -- _SUCCESS --------------------------------------------------------------------------------------


def test_success_of_a_lower_lease_generation_than_the_highest_document_is_stale(tmp_path):
    store = open_store(str(tmp_path / "out"))
    first = acquire_lease(store, ttl_s=60, renew=False)
    put_success(store, {"status": "succeeded"}, first.generation)
    assert success_file(store).doc["lease"] == 0
    first.release()
    second = acquire_lease(store, ttl_s=60, renew=False)
    found = success_file(store)
    assert found.doc is None and found.stale == (
        "_SUCCESS was written by lease generation 0, but generation 1 has taken the output since: "
        "stale; the run that owns the output writes a new one"
    )
    assert success_file(store, holder=second.generation).doc is not None  # the holder's own view
    # The new owner replaces it; the paused old owner's later write is refused.
    put_success(store, {"status": "succeeded"}, second.generation)
    with pytest.raises(SuccessStale):
        put_success(store, {"status": "succeeded"}, first.generation)
    assert success_file(store).doc["lease"] == 1
    # Written by an earlier version (no "lease"): believed.
    store.put("_SUCCESS", b'{"status": "succeeded"}')
    assert success_file(store).doc == {"status": "succeeded"}


# -- verify ----------------------------------------------------------------------------------------


def _crashed_redo(root) -> tuple[LocalStore, list[str], list[str], str]:
    """Two shards committed, then a redo of shard 0 that committed generation 1 and died before
    superseding (its lease document never settled), and a redo of shard 1 that never committed,
    with a straggler's upload; a `_SUCCESS` of the first run."""
    store = LocalStore(str(root))
    old = commit(store, 0, 0, new_attempt_token(0))
    commit(store, 1, 0, new_attempt_token(0))
    store.put(
        "_job.json", json.dumps({"fingerprint": "t", "plan": {"shards": 2, "rows": 4, "images": 4}}).encode()
    )
    first = acquire_lease(store, ttl_s=60, renew=False)
    put_success(store, {"status": "succeeded", "images": {"ok": 4, "failed": 0}}, first.generation)
    first.mark_settled()
    first.release()
    dead = acquire_lease(store, ttl_s=60, renew=False)
    dead.record_work([0, 1], {0: 1, 1: 1})
    new = commit(store, 0, 1, new_attempt_token(0, 1))
    late = straggler(store, 1, 1)
    # The driver died: its document stays unreleased and unsettled; its lease runs out.
    store.put(
        f"_lease/{dead.generation:08d}.json",
        json.dumps({**json.loads(store.get(f"_lease/{dead.generation:08d}.json")), "expires_at": 0}).encode(),
    )
    return store, old, new, late


def test_verify_says_a_stale_success_and_clean_seals_supersedes_and_deletes_by_the_rule(tmp_path):
    from ditfleet.driver.output.verify import verify_output

    store, old, new, late = _crashed_redo(tmp_path / "out")
    report = verify_output(store)
    assert report.stale_success and "generation 1 has taken the output" in report.stale_success
    assert not report.success and report.exit_code == 1
    assert store.exists(late) and report.pending == 1  # generation 1 of shard 1 has no key: in play

    cleaned = verify_output(store, clean=True)
    assert cleaned.superseded == 1 and cleaned.sealed == 1
    assert manifest_kind(store.get(manifest_key(1, 1))) == ManifestKind(SEALED)
    assert manifest_kind(store.get(manifest_key(0))) == ManifestKind(SUPERSEDED, 1)
    assert not store.exists(late)  # sealed: provably lost, deleted in the same pass
    assert all(store.exists(superseded_key(k)) and not store.exists(k) for k in old)
    assert all(store.exists(k) for k in new)
    _readers_see_each_row_once_with_its_object(store)
    # The stale _SUCCESS stays stale (the run that owns the output writes a new one).
    assert success_file(store).doc is None


def test_verify_clean_of_a_complete_output_leaves_its_success_believed(tmp_path):
    from ditfleet.driver.output.verify import verify_output

    store = LocalStore(str(tmp_path / "out"))
    commit(store, 0, 0, new_attempt_token(0))
    loser = straggler(store, 0, 0)
    store.put(
        "_job.json", json.dumps({"fingerprint": "t", "plan": {"shards": 1, "rows": 2, "images": 2}}).encode()
    )
    run = acquire_lease(store, ttl_s=60, renew=False)
    put_success(store, {"status": "succeeded", "images": {"ok": 2, "failed": 0}}, run.generation)
    run.mark_settled()
    run.release()
    report = verify_output(store, clean=True)
    assert report.cleaned == 1 and not store.exists(loser) and report.exit_code == 0, report.problems
    # verify's lease (generation 1) keeps a complete output complete: the driver's _SUCCESS stands.
    assert success_file(store).doc["lease"] == 0 and success_file(store).stale is None
    assert verify_output(store).exit_code == 0
    # A driver's newer lease does make it stale.
    acquire_lease(store, ttl_s=60, renew=False).release()
    assert success_file(store).doc is None and "stale" in success_file(store).stale
