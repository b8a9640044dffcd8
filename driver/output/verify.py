"""`ditfleet verify OUT`: check an output end to end from what it holds, nothing else.

What it checks and guarantees, and what it cannot see, is in docs/reliability.md#verify; every
problem is one line naming the shard, row or key. Here, in order: the plan (`_job.json`, or an
incremental job's run records); the manifests (each read by driver.output.verify_shards, on
threads or Ray tasks), every input row in exactly one; the format areas against them, where a
key no current manifest names is an orphan only when the one rule of driver.output.orphans
proves it lost, pending when its generation has no manifest key yet, and a PROBLEM otherwise;
`_SUCCESS` and the compacted set.

Manifests are read before the data areas are listed: an object a manifest names was stored
before that manifest was written, so a running job cannot make a committed object look missing.
Exit 0 when nothing is wrong and the output is complete (or `partial` was asked for).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.output.compact import check_compacted
from ditfleet.driver.output.json_objects import read_json
from ditfleet.driver.output.lease import OutputBusy, acquire_lease
from ditfleet.driver.output.orphans import (
    ShardRecord,
    delete_keys,
    manifest_object_key,
    read_shard_record,
)
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.driver.output.settle import settle_older
from ditfleet.driver.output.success import success_file
from ditfleet.driver.output.supersede import supersede_pending
from ditfleet.driver.output.verify_report import MAX_LISTED, VerifyReport
from ditfleet.driver.output.verify_shards import (
    CommittedShard,
    ShardChecks,
    ThreadChecks,
    VerifyPlan,
    check_object_group,
    read_manifest_group,
    read_plan,
)
from ditfleet.workers.output.formats import FORMAT_AREAS, ManifestImage, attempt_object, object_key
from ditfleet.workers.output.layout import (
    MANIFESTS_PREFIX,
    SUPERSEDED_PREFIX,
    job_key,
    manifest_key,
    manifest_of_key,
    superseded_key,
)
from ditfleet.workers.output.manifest import (
    MANIFEST,
    SUPERSEDED,
    current_manifest_key,
    current_of,
    manifest_generations,
)
from ditfleet.workers.storage import ObjectStore


def verify_output(
    store: ObjectStore,
    *,
    partial: bool = False,
    clean: bool = False,
    hash_objects: bool = True,
    workers: int | None = None,
    shard_checks: ShardChecks | None = None,
) -> VerifyReport:
    """Check the output at `store`; with `clean`, delete the orphans found (attempt objects of
    committed shards that their current manifest does not name).

    workers: threads reading manifests and objects (and deleting); None: `store.read_threads()`;
    only the time depends on it. shard_checks: where the per-shard checks run (default: those
    threads; Ray tasks: driver.output.verify_ray).

    With `clean` it first takes the output's lease, as a driver does (so it does not clean
    while a run works on the output; nothing it deletes depends on that), then seals,
    supersedes and deletes only as driver.output.settle, supersede and orphans allow. Its lease
    keeps a complete output complete (it does not make `_SUCCESS` stale).
    """
    workers = store.read_threads() if workers is None else workers
    if workers < 1:
        raise ValueError(f"verify needs at least one worker thread, got {workers}")
    checks = shard_checks or ThreadChecks(workers)
    if not clean:
        return _verify(store, partial, False, hash_objects, workers, checks)
    try:
        lease = acquire_lease(store, keeps_complete=True)
    except OutputBusy as e:
        report = _verify(store, partial, False, hash_objects, workers, checks)
        report.problems.append(f"--clean deleted nothing: {e}")
        return report
    try:
        settled = settle_older(store, lease.generation)
        superseded = supersede_pending(store)
        report = _verify(store, partial, True, hash_objects, workers, checks, lease.generation)
        report.sealed, report.superseded = len(settled.sealed), len(superseded.generations)
        # The older lease documents stay (a driver deletes those it settled): a `_SUCCESS` that
        # one of them made stale must stay stale, and this lease, which keeps a complete output
        # complete, does not count for that (driver.output.success).
        lease.mark_settled()
        return report
    finally:
        lease.release()


def _verify(
    store: ObjectStore,
    partial: bool,
    clean: bool,
    hash_objects: bool,
    workers: int,
    checks: ShardChecks,
    holder: int | None = None,
) -> VerifyReport:
    report = VerifyReport(output=store.uri(), partial=partial)
    try:
        job = read_json(store, job_key())
        found = success_file(store, holder)
    except ValueError as e:
        report.problems.append(str(e))
        return report
    success, report.stale_success = found.doc, found.stale
    if job is None:
        report.problems.append(
            f"{store.uri(job_key())} is missing: not a ditfleet output, or no run got past planning"
        )
        return report
    report.success = success is not None
    plan = read_plan(store, job, report)
    if plan is None:
        return report
    report.planned_shards = len(plan.shards)
    manifests = _read_manifests(store, plan, report, checks)  # first: see the module docstring
    _check_rows_once(manifests.shards, plan, report)
    _check_objects(store, manifests, plan, report, hash_objects, checks)
    if success is not None:
        _check_success(success, plan, report)
    report.problems.extend(check_compacted(store))
    report.orphans.sort()
    if clean and report.orphans:
        pause_point("verify_before_delete")
        report.cleaned = delete_keys(store, report.orphans, workers)
    elif success is not None and report.orphans:
        report.problems.append(
            f"{len(report.orphans)} objects of losing runs lie in the data areas after _SUCCESS "
            f"(e.g. {store.uri(report.orphans[0])}): readers of the data folders see them; "
            "`ditfleet verify --clean` deletes them"
        )
    return report


@dataclass(frozen=True)
class _Manifests:
    """What the manifests of the plan's shards say."""

    committed: set[int]  # the shards with a current manifest
    shards: list[CommittedShard]  # what those current manifests that could be read say
    generations: dict[int, dict[int, str]]  # every shard's generations' manifest keys


def _read_manifests(
    store: ObjectStore, plan: VerifyPlan, report: VerifyReport, checks: ShardChecks
) -> _Manifests:
    """A shard's current manifest is its highest generation that is not a seal (a redo's); the
    lower ones it supersedes are tombstones, their rows kept under `_superseded/`."""
    keys: list[str] = []
    for key in store.list(MANIFESTS_PREFIX):
        found = manifest_of_key(key)
        if found is None:
            report.problems.append(f"{store.uri(key)}: stray file in manifests/ (not a shard manifest)")
        elif found[0] not in plan.shards:
            report.problems.append(
                f"{store.uri(key)}: manifest of shard {found[0]}, which the plan does not have (or superseded)"
            )
        else:
            keys.append(key)
    generations = manifest_generations(keys)
    current = {s: k for s, g in generations.items() if (k := current_of(store, g)) is not None}
    committed = sorted(current)
    report.committed = len(committed)
    report.missing = sorted(plan.shards - set(committed))
    shards = []
    # Each shard's problems are merged in shard order: the report is the same wherever and in
    # whatever order the shards were read.
    for shard, problems in checks.run(read_manifest_group, store, [(s, current[s]) for s in committed], plan):
        report.problems.extend(problems)
        if shard:
            shards.append(shard)
    return _Manifests(set(committed), shards, generations)


def _check_rows_once(shards: list[CommittedShard], plan: VerifyPlan, report: VerifyReport) -> None:
    """Every row exactly once over the output, each id's images k = 0..n-1, the plan's counts."""
    if shards:
        table = pa.table(
            {"id": pa.chunked_array([s.ids for s in shards]), "k": pa.chunked_array([s.ks for s in shards])}
        )
        by_pair = table.group_by(["id", "k"]).aggregate([([], "count_all")])
        dups = by_pair.filter(pc.greater(by_pair.column("count_all"), 1))
        for id_, k, n in zip(*(dups.column(c).to_pylist()[:MAX_LISTED] for c in ("id", "k", "count_all"))):
            report.problems.append(f"row id={id_!r} k={k} is in {n} manifests (a row must be in one)")
        by_id = table.group_by("id").aggregate([("k", "min"), ("k", "max"), ("k", "count_distinct")])
        gaps = by_id.filter(
            pc.or_(
                pc.not_equal(by_id.column("k_min"), 0),
                pc.not_equal(pc.add(by_id.column("k_max"), 1), by_id.column("k_count_distinct")),
            )
        )
        for id_ in gaps.column("id").to_pylist()[:MAX_LISTED]:
            report.problems.append(f"row id={id_!r}: its images are not k = 0..n-1 (one is missing)")
        report.rows = by_id.num_rows
    report.images_ok = sum(len(s.ok) for s in shards)
    report.images_failed = sum(s.failed for s in shards)
    images = report.images_ok + report.images_failed
    if not report.missing and plan.rows is not None and plan.images is not None:
        if report.rows != plan.rows or images != plan.images:
            report.problems.append(
                f"the manifests hold {report.rows} rows / {images} images, the plan has "
                f"{plan.rows} / {plan.images}"
            )


def _named_objects(
    root: str, shards: list[CommittedShard], report: VerifyReport
) -> dict[str, list[ManifestImage]]:
    """Key -> the ok rows that name it (a moved output's keys are found by their format area).
    Sets each shard's tokens, and `accounted` False where a row's uri is no object of its shard."""
    named: dict[str, list[ManifestImage]] = defaultdict(list)
    for s in shards:
        for r in s.ok:
            key, why = manifest_object_key(root, s.shard, r.uri)
            if key is None:
                s.accounted = False
                report.problems.append(f"shard {s.shard} row {r.label}: {why}")
                continue
            if report.moved_from is None and object_key(root, r.uri)[1]:
                report.moved_from = r.uri[: -len(key) - 1]
            s.tokens.add(attempt_object(key).attempt)  # type: ignore[union-attr]  # checked above
            named[key].append(r)
    return named


def _records(
    store: ObjectStore, shards: list[CommittedShard], generations: dict[int, dict[int, str]]
) -> dict[int, ShardRecord]:
    """The one rule's record of each committed shard: a shard with one generation is what its
    current manifest (read already) says; one with more has every generation read."""
    records: dict[int, ShardRecord] = {}
    for s in shards:
        keys = generations.get(s.shard, {})
        if list(keys) == [0]:
            records[s.shard] = ShardRecord(
                s.shard, {0: MANIFEST}, frozenset(s.tokens), s.accounted, frozenset(), {0: ()}
            )
        else:
            records[s.shard] = read_shard_record(store, s.shard, keys)
    return records


def _check_superseded(
    store: ObjectStore, records: dict[int, ShardRecord], listed: set[str], report: VerifyReport, done: bool
) -> None:
    """Lower generations still in the reader-visible folders (a problem once `_SUCCESS` is
    there), and the history under `_superseded/` against the manifests kept there."""
    history: set[str] | None = None
    for record in records.values():
        if len(record.kinds) < 2:
            continue
        current = max((g for g, k in record.kinds.items() if k == MANIFEST), default=None)
        if current is None:
            continue
        for g in sorted(g for g, k in record.kinds.items() if g < current and k in (MANIFEST, SUPERSEDED)):
            left = [k for k in record.named_by.get(g, ()) if k in listed]
            if done and (record.kinds[g] == MANIFEST or left):
                report.problems.append(
                    f"shard {record.shard}: generation {g} is superseded by generation {current} but "
                    + (
                        "its manifest still holds rows in manifests/"
                        if record.kinds[g] == MANIFEST
                        else f"{len(left)} of its objects still lie in the data areas (e.g. {store.uri(left[0])})"
                    )
                    + ": readers see it next to the current one; `ditfleet verify --clean` finishes its supersession"
                )
            if record.kinds[g] != SUPERSEDED:
                continue
            if history is None:
                history = set(store.list(SUPERSEDED_PREFIX))
            gone = [
                k for k in record.named_by.get(g, ()) if superseded_key(k) not in history and k not in listed
            ]
            report.history_missing.extend(store.uri(superseded_key(k)) for k in gone)


def _check_objects(
    store: ObjectStore,
    manifests: _Manifests,
    plan: VerifyPlan,
    report: VerifyReport,
    hash_objects: bool,
    checks: ShardChecks,
) -> None:
    """The format areas against the manifests: orphans (by the one rule), pending and stray
    objects, missing ones, and (hash_objects) every named object read through its format's
    reader."""
    named = _named_objects(store.uri(), manifests.shards, report)
    records = _records(store, manifests.shards, manifests.generations)
    listed = _judge_unnamed(store, named, manifests, records, plan, report)
    _check_superseded(store, records, listed, report, report.success)
    for key, rows in named.items():
        if key not in listed:
            report.problems.append(f"{store.uri(key)}: missing (named by {len(rows)} ok manifest rows)")
    if hash_objects:
        present = [k for k in named if k in listed]
        for found in checks.run(check_object_group, store, [(k, named[k]) for k in present]):
            report.problems.extend(found)
        report.objects_checked = sum(len(named[k]) for k in present)


def _judge_unnamed(
    store: ObjectStore,
    named: dict[str, list[ManifestImage]],
    manifests: _Manifests,
    records: dict[int, ShardRecord],
    plan: VerifyPlan,
    report: VerifyReport,
) -> set[str]:
    """Every key in the format areas; each one no current manifest names is kept (its shard's
    manifests cannot be accounted for), a problem (under the committed run's token), an orphan
    (the one rule proves it lost), left to _check_superseded, pending, or a stray."""
    by_shard = {s.shard: s for s in manifests.shards}
    kept: Counter = Counter()  # shard -> objects kept because its manifests cannot be accounted for
    listed: set[str] = set()
    for prefix in FORMAT_AREAS:
        for key in store.list(prefix):
            listed.add(key)
            if key in named:
                continue
            obj = attempt_object(key)
            read = by_shard.get(obj.shard) if obj is not None else None
            record = records.get(obj.shard) if obj is not None else None
            if (
                obj is not None
                and obj.shard in manifests.committed
                and (read is None or not read.accounted or record is None or not record.accounted)
            ):
                kept[obj.shard] += 1
            elif read is not None and obj is not None and obj.attempt in read.tokens:
                report.problems.append(
                    f"{store.uri(key)}: no manifest names it, but it lies under the committed run's "
                    f"token {obj.attempt} of shard {obj.shard} (a file added after the commit; kept)"
                )
            elif record is not None and record.is_lost(key):
                report.orphans.append(key)
            elif record is not None and obj is not None and obj.attempt in record.named:
                continue  # named by a superseded generation, not moved yet: _check_superseded says so
            elif obj is not None and obj.shard in plan.shards:
                report.pending += 1
            else:
                report.problems.append(
                    f"{store.uri(key)}: stray object (no manifest names it, and it is not an attempt "
                    "object of a planned shard)"
                )
    for shard, n in sorted(kept.items()):
        report.problems.append(
            f"shard {shard}: {n} objects no readable manifest row names are kept untouched: the "
            f"shard's manifest {store.uri(current_manifest_key(store, shard) or manifest_key(shard))} cannot be fully read, so which of "
            "them it commits is unknown (restore the manifest, then verify again)"
        )
    return listed


def _check_success(success: dict[str, Any], plan: VerifyPlan, report: VerifyReport) -> None:
    """`_SUCCESS` only when every planned shard is committed, with the manifests' counts."""
    if report.missing:
        report.problems.append(
            f"_SUCCESS is present but {len(report.missing)} planned shards are not committed "
            f"(e.g. {report.missing[:5]}): the output is not complete; run the job again"
        )
    elif not plan.incremental:
        said = (success.get("images") or {}) if isinstance(success.get("images"), dict) else {}
        if (said.get("ok"), said.get("failed")) != (report.images_ok, report.images_failed):
            report.problems.append(
                f"_SUCCESS says {said.get('ok')} images ok / {said.get('failed')} failed, the "
                f"manifests {report.images_ok} / {report.images_failed}"
            )
