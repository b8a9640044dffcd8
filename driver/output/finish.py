"""The end of a run, one path for plain and incremental jobs: count, summarise, close the
output, `_SUCCESS`.

Dispatch returns only after it has fenced every actor it started (driver.output.fence). The
driver then counts rows and images from the manifests of the run's shards and closes the output
(`close_output`), in this order:
1. seal its own redo generations that did not commit (a straggler of them can never commit);
2. supersede every shard whose lower generation still has rows or objects in the
   reader-visible folders (driver.output.supersede: its own redos, and any a crashed run left);
   a redo names the `ditfleet score` tables it left without its generation (it does not rescore);
3. delete what the one rule proves lost (driver.output.orphans) in its own shards and in the
   shards of every older lease document it settled (driver.output.settle), so a crashed run's
   leftovers are cleaned too;
4. when every shard is committed, write `_SUCCESS` stamped with its lease generation
   (driver.output.success), right after checking the lease;
5. mark its lease document settled and delete the older ones it settled.
None of these steps needs the lease to be safe: a driver paused anywhere in them for any time
can only seal what is absent, supersede what is superseded, delete what is lost, and write a
`_SUCCESS` that is stale once another driver took the output. The lease checks only stop a
driver that lost the output from doing duplicate work.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping
from typing import TextIO

from ditfleet.driver.output.compact import COMPACTED_KEY, refresh_compacted
from ditfleet.driver.output.lease import OutputLease
from ditfleet.driver.output.near_duplicate_counts import output_near_duplicates
from ditfleet.driver.output.orphans import delete_lost
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.driver.output.settle import Settled, delete_settled, seal_generations
from ditfleet.driver.output.status import count_shards
from ditfleet.driver.output.success import put_success
from ditfleet.driver.output.summary import JobSummary, RunOutcome, build_summary
from ditfleet.driver.output.supersede import supersede_pending
from ditfleet.workers.output.manifest import committed_shards, current_manifest_keys
from ditfleet.workers.output.score_table import all_score_tables
from ditfleet.workers.storage import ObjectStore

_TIMINGS = ("plan_s", "dispatch_s", "count_s", "wall_s")


def finish_run(
    store: ObjectStore,
    run: RunOutcome,
    *,
    started: float,
    out: TextIO,
    lease: OutputLease | None = None,
    settled: Settled | None = None,
    verbose: bool = False,
) -> JobSummary:
    """Count `run.shards`, close the output and print the summary (`verbose`: with the model's
    internals, JobSummary.format_text); returns it.

    run.timings: plan_s and dispatch_s (count_s and wall_s are added, from `started`, a
    time.monotonic() value); lease: the driver's (None: tests that run shards without a driver);
    settled: what settling the older lease documents found when the lease was taken.
    """
    t0 = time.monotonic()
    committed = sorted(committed_shards(store) & {s.index for s in run.shards})
    counts = count_shards(store, committed)
    near_duplicates = output_near_duplicates(store, committed)
    now = time.monotonic()
    timings = {**dict.fromkeys(_TIMINGS, 0.0), **run.timings, "count_s": now - t0, "wall_s": now - started}
    summary = build_summary(store.uri(), dataclasses.replace(run, timings=timings), counts, near_duplicates)
    unfenced = run.dispatch.unfenced_actors if run.dispatch is not None else []
    if unfenced:
        print(
            f"WARNING: {len(unfenced)} killed actor(s) still had a live process when the driver "
            f"stopped waiting ({', '.join(unfenced[:5])}); anything they still upload is an orphan "
            "that no manifest names: `ditfleet verify --clean` removes it",
            file=out,
        )
    close_output(
        store,
        lease=lease,
        settled=settled or Settled(),
        own={s.index for s in run.shards if s.index not in run.committed_before},
        redo={s.index: s.generation for s in run.shards if s.generation},
        success=summary if summary.shards["left"] == 0 else None,
        out=out,
    )
    print(summary.format_text(verbose), file=out)
    return summary


def close_output(
    store: ObjectStore,
    *,
    lease: OutputLease | None,
    settled: Settled,
    own: Collection[int],
    redo: Mapping[int, int],
    success: JobSummary | None,
    out: TextIO,
) -> None:
    """Steps 1-5 of the module docstring. own: the shards this run dispatched; redo: their
    redo generations; success: the summary to write as `_SUCCESS` (None: not complete)."""
    if redo:
        pause_point("after_redo_commit")
        sealed = seal_generations(store, sorted(redo.items()))
        if sealed:
            print(f"sealed {len(sealed)} redo generation(s) that did not commit: {sealed[:10]}", file=out)
    superseded = supersede_pending(store)
    if superseded.generations:
        print(
            f"moved {len(superseded.generations)} superseded manifest generation(s) and their "
            f"{superseded.moved} objects under {store.uri('_superseded')}",
            file=out,
        )
    if redo:  # a redo does not rescore: say which `ditfleet score` tables it left behind
        for tables in all_score_tables(store, current_manifest_keys(store)):
            if note := tables.note(store.uri(), redo):
                print(f"note: {note}", file=out)
    _check(lease)
    pause_point("after_lease_check")
    shards = None if settled.shards is None else set(own) | settled.shards
    cleaned = delete_lost(store, shards, before_delete=lambda: pause_point("in_cleanup"))
    if cleaned:
        print(f"removed {cleaned} objects of losing or killed runs (no manifest names them)", file=out)
    pause_point("before_success")
    if success is not None:
        _check(lease)
        # A compacted set the user made is kept the union of the current manifests (a redo), and
        # one a compaction this driver took the output from may still write is fenced.
        if refresh_compacted(store, lease) is not None:
            print(
                f"rebuilt the compacted set {store.uri(COMPACTED_KEY)} from the current manifests", file=out
            )
        put_success(store, success.to_dict(), lease.generation if lease is not None else None)
    if lease is not None:
        lease.mark_settled()
        delete_settled(store, settled.documents, lease.generation)


def _check(lease: OutputLease | None) -> None:
    if lease is not None:
        lease.check()
