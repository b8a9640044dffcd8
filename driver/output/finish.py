"""The end of a run, one path for plain and incremental jobs: count, summarise, clean up, `_SUCCESS`.

Dispatch returns only after it has fenced every actor it started (driver.output.fence: each one's
process is gone). The driver then counts rows and images from the manifests of the run's shards,
warns about actors whose process outlived the fence wait, deletes the orphans of the shards this
run committed (objects of losing or killed runs, which no manifest names, see
workers.output.layout) and, when every shard is committed, writes `_SUCCESS` (the summary, JSON):
at that point nothing of the job writes any more, and the data areas hold exactly what the
manifests name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from ditfleet.driver.dispatch import DispatchResult
from ditfleet.driver.output.orphans import clean_orphans
from ditfleet.driver.output.status import count_shards
from ditfleet.driver.output.summary import JobSummary, build_summary, write_success
from ditfleet.driver.progress import JobProgress
from ditfleet.workers.output.manifest import committed_shards
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore

_TIMINGS = ("plan_s", "dispatch_s", "count_s", "wall_s")


def finish_run(
    store: ObjectStore,
    *,
    shards: Sequence[ShardSpec],
    committed_before: frozenset[int],
    fingerprint: str,
    planned: Mapping[str, int],
    result: DispatchResult | None,
    progress: JobProgress,
    timings: Mapping[str, float],
    started: float,
    out: TextIO,
    before_write: Callable[[], None] | None = None,
) -> JobSummary:
    """Count `shards` (all that the summary is over: a plain job's plan, or the shards of one
    incremental run), finish the output and print the summary; returns it.

    committed_before: those of `shards` committed before this run (left alone by the clean-up);
    planned: {'shards', 'rows', 'images'} of `shards`; result: None when nothing was dispatched;
    timings: plan_s and dispatch_s (count_s and wall_s are added, from `started`, a
    time.monotonic() value); before_write: called before the clean-up and before `_SUCCESS`, and
    raises when this driver may not write them (driver.output.lease: another owns the output).
    """
    t0 = time.monotonic()
    committed = committed_shards(store) & {s.index for s in shards}
    counts = count_shards(store, sorted(committed))
    now = time.monotonic()
    summary = build_summary(
        output=store.uri(),
        fingerprint=fingerprint,
        planned=dict(planned),
        committed_before=len(committed_before),
        counts=counts,
        dispatch=result,
        progress=progress,
        timings={**dict.fromkeys(_TIMINGS, 0.0), **timings, "count_s": now - t0, "wall_s": now - started},
    )
    _finish_output(store, summary, result, committed - committed_before, out, before_write or (lambda: None))
    print(summary.format_text(), file=out)
    return summary


def _finish_output(
    store: ObjectStore,
    summary: JobSummary,
    result: DispatchResult | None,
    ran: set[int],
    out: TextIO,
    before_write: Callable[[], None],
) -> None:
    """Warn about actors the fence could not confirm gone, delete the orphans of the shards `ran`
    (committed ones only have any), then write `_SUCCESS` if every planned shard is committed."""
    unfenced = result.unfenced_actors if result is not None else []
    if unfenced:
        print(
            f"WARNING: {len(unfenced)} killed actor(s) still had a live process when the driver "
            f"stopped waiting ({', '.join(unfenced[:5])}); anything they still upload is an orphan "
            "that no manifest names: `ditfleet verify --clean` removes it",
            file=out,
        )
    before_write()
    cleaned = clean_orphans(store, sorted(ran))
    if cleaned:
        print(f"removed {cleaned} objects of losing or killed runs (no manifest names them)", file=out)
    if summary.shards["left"] == 0:
        before_write()
        write_success(store, summary)
