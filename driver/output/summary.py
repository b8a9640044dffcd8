"""The job summary: what `_SUCCESS` holds and what the driver prints at the end.

Counts of rows and images are over the whole output (earlier runs included), read from the
manifests; timings, start-up costs and per-worker throughput are this run's.

`_SUCCESS` holds it, stamped with the lease generation that wrote it (driver.output.success).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ditfleet.driver.dispatch.types import DispatchResult
from ditfleet.driver.output.cost import CostConfig, cost_line, cost_summary
from ditfleet.driver.output.near_duplicate_counts import near_duplicate_line
from ditfleet.driver.output.status import OutputCounts, gate_line
from ditfleet.driver.output.success import success_file
from ditfleet.driver.progress import JobProgress, compile_fallbacks, format_duration, plural, warmup_seconds
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore

SUMMARY_VERSION = 1

# A worker's speed, as the run's summary and the report (jobs/report.py) both give it: images per
# second of generation time (the DiT, VAE and text encoder for its batches: the manifests'
# generate_s), so that start-up, queueing, encode and upload do not count against a worker.
RATE_NAME = "img/s of generation time"


def generation_rate(images: int, generate_s: float) -> float:
    """Images per second of generation time (RATE_NAME); 0 when nothing was generated."""
    return images / generate_s if generate_s > 0 else 0.0


SUCCEEDED = "succeeded"  # every shard committed, every image ok
COMPLETED_WITH_FAILURES = "completed_with_failures"  # every shard committed, some images failed
FAILED = "failed"  # some shards failed: no _SUCCESS, run the same command again to retry them
_HEADS = {
    SUCCEEDED: "job succeeded",
    COMPLETED_WITH_FAILURES: "job completed, but some images FAILED",
    FAILED: "job FAILED: some shards could not be committed",
}
_ADVICE = {
    FAILED: "  Run the same command again to retry the failed shards; committed ones are kept.",
    COMPLETED_WITH_FAILURES: "  Failed images have status 'failed' and an error in the manifests.",
}


@dataclass
class JobSummary:
    status: str
    output: str
    fingerprint: str
    shards: dict[str, int]  # planned, committed, committed_before, committed_now, failed, left
    rows: dict[str, int]  # planned, ok, failed
    images: dict[str, int]  # planned, ok, failed
    failures_by_error: dict[str, int]  # image errors (from the manifests) and shard errors
    failed_shards: list[dict[str, Any]]  # {shard, attempts, kind, error}
    timings: dict[str, float]  # wall_s, plan_s, dispatch_s, count_s; generate/encode/upload sums
    startup: dict[str, Any]  # actors, load/warm-up/start-up means and maxima, per worker
    workers: dict[str, dict[str, Any]]  # per worker: shards, images, busy_s, images_per_s
    dispatch: dict[str, int]  # DispatchStats
    recompiles: int = 0  # compilations on the request path, over all shards (should be 0)
    # Batches halved after a CUDA out-of-memory error: their images differ at rounding level
    # from an unsplit batch's. A smaller workers.batch_size avoids them.
    oom_splits: int = 0
    attention: dict[str, Any] = field(default_factory=dict)  # DiT attention counts and shares
    compile_fallbacks: dict[str, dict[str, str]] = field(default_factory=dict)  # worker -> target -> why
    # The step cache's share of the DiT work (empty when no image used one): block evaluations
    # computed and reused over the committed images, reused_share = reused / (computed + reused).
    step_cache: dict[str, Any] = field(default_factory=dict)
    # quality.gate over the committed images (OutputCounts.gate): pass rate, tries per image.
    quality_gate: dict[str, Any] = field(default_factory=dict)
    # Near duplicates among the committed images (driver.output.near_duplicate_counts): images
    # counted, those near an earlier image of their prompt or of another; {} without phashes.
    near_duplicates: dict[str, Any] = field(default_factory=dict)
    # What this run's fleet cost (DispatchResult.fleet): GPU hours split into start-up,
    # generating and idle, and images per GPU hour; empty when nothing was dispatched.
    fleet: dict[str, Any] = field(default_factory=dict)
    # What an image cost (driver.output.cost): GPU-seconds per image by bucket over the committed
    # images, this run's fleet per image, and dollars per million at cost.gpu_hour_usd.
    cost: dict[str, Any] = field(default_factory=dict)
    version: int = SUMMARY_VERSION
    lease: int | None = None  # the lease generation of the driver that wrote `_SUCCESS`

    @property
    def exit_code(self) -> int:
        """0 only when every shard committed and every image is ok."""
        return 0 if self.status == SUCCEEDED else 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self, verbose: bool = False) -> str:
        """The summary as printed; `verbose` adds the model's internals (the attention counters),
        which _SUCCESS and --json keep either way."""
        return "\n".join([*self._count_lines(), *self._run_lines(verbose), *self._problem_lines()])

    def _count_lines(self) -> list[str]:
        s, r, i, t = self.shards, self.rows, self.images, self.timings
        return [
            f"{_HEADS[self.status]}: {self.output}",
            f"  shards: {s['committed']}/{s['planned']} committed ({s['committed_now']} now, "
            f"{s['committed_before']} before), {s['failed']} failed",
            f"  rows:   {r['ok']} ok, {r['failed']} failed of {r['planned']}",
            f"  images: {i['ok']} ok, {i['failed']} failed of {i['planned']}",
            f"  time:   {format_duration(t['wall_s'])} (plan {t['plan_s']:.1f} s, dispatch "
            f"{format_duration(t['dispatch_s'])})",
        ]

    def _run_lines(self, verbose: bool = False) -> list[str]:
        """What this run's fleet did, and what the committed images say (each line when known)."""
        lines = []
        st, a, sc = self.startup, self.attention, self.step_cache
        if st.get("actors"):
            lines.append(
                f"  start-up: {st['actors']} actors ready in {st['ready_s_mean']:.1f} s on average "
                f"(max {st['ready_s_max']:.1f} s; model load {st['load_s_mean']:.1f} s, "
                f"warm-up {st['warmup_s_mean']:.1f} s)"
            )
        if self.fleet:
            lines.append(f"  fleet:  {fleet_line(self.fleet)}")
        if self.cost:
            lines.append(f"  cost:   {cost_line(self.cost)}")
        for worker, w in sorted(self.workers.items()):
            lines.append(
                f"  worker {worker}: {w['shards']} shards, {w['images_ok']} images, "
                f"{generation_rate(w['images_ok'] + w['images_failed'], w['generate_s']):.2f} {RATE_NAME}"
            )
        if verbose and a.get("calls"):
            lines.append(
                f"  DiT attention: {a['calls']} calls, {a['masked_call_share']:.1%} with a dense mask, "
                f"{a['padded_call_share']:.1%} padded; padding {a['padded_token_share']:.2%} of tokens"
            )
        if sc.get("blocks_computed"):
            lines.append(
                f"  step cache: {sc['reused_share']:.1%} of DiT block evaluations reused "
                f"({sc['blocks_computed'] + sc['blocks_reused']} -> {sc['blocks_computed']} computed, "
                f"{sc['work_speedup']:.2f}x less DiT work)"
            )
        if self.quality_gate:
            lines.append(f"  quality gate: {gate_line(self.quality_gate)}")
        if self.near_duplicates:
            lines.append(f"  near duplicates: {near_duplicate_line(self.near_duplicates)}")
        return lines

    def _problem_lines(self) -> list[str]:
        """Warnings, what failed, and what to do about it."""
        lines = []
        if self.recompiles:
            lines.append(f"  WARNING: {self.recompiles} compilations on the request path (expected 0)")
        if self.oom_splits:
            lines.append(
                f"  WARNING: {plural(self.oom_splits, 'OOM split')}: batches halved after CUDA out of memory; "
                "their images differ at rounding level from unsplit ones (a smaller workers.batch_size avoids it)"
            )
        lines.extend(f"  WARNING: {worker} ran eager: {fb}" for worker, fb in self.compile_fallbacks.items())
        lines.extend(f"  failed x{n}: {message}" for message, n in self.failures_by_error.items())
        lines.extend(
            f"  shard {f['shard']} failed after {plural(f['attempts'], 'attempt')}: {f['error']}"
            for f in self.failed_shards
        )
        if self.status in _ADVICE:
            lines.append(_ADVICE[self.status])
        return lines


def read_success(
    store: ObjectStore, holder: int | None = None, out: TextIO | None = None
) -> JobSummary | None:
    """The summary in `_SUCCESS`; None when there is none, it is stale (said on `out`), or it
    was written by another version (then the caller counts again)."""
    found = success_file(store, holder)
    if found.stale and out is not None:
        print(found.stale, file=out)
    if found.doc is None:
        return None
    names = {f.name for f in dataclasses.fields(JobSummary)}
    try:
        return JobSummary(**{k: v for k, v in found.doc.items() if k in names})
    except TypeError:
        return None


def _stats(values: list[float]) -> tuple[float, float]:
    return (statistics.fmean(values), max(values)) if values else (0.0, 0.0)


def attention_summary(per_worker: list[dict[str, int]]) -> dict[str, Any]:
    """Summed DiT attention counts and the shares that say whether the fast path was taken:
    calls with a dense mask, padded calls (any kernel), padded tokens of all tokens computed."""
    total: dict[str, Any] = {}
    for counts in per_worker:
        for name, value in counts.items():
            total[name] = total.get(name, 0) + int(value)
    calls = total.get("calls", 0)
    tokens = total.get("image_tokens", 0) + total.get("text_tokens", 0)
    if calls:
        total["masked_call_share"] = round(total.get("masked_calls", 0) / calls, 4)
        padded_calls = total.get("masked_calls", 0) + total.get("split_calls", 0)
        total["padded_call_share"] = round(padded_calls / calls, 4)
        total["padded_token_share"] = round(total.get("padded_tokens", 0) / tokens, 4) if tokens else 0.0
    return total


def startup_summary(reports: dict[str, dict]) -> dict[str, Any]:
    """Means and maxima of the actors' start-up costs, and each actor's report."""
    startup = [float(r["ready_s"]) for r in reports.values() if isinstance(r.get("ready_s"), (int, float))]
    load = [float(r["load_s"]) for r in reports.values() if isinstance(r.get("load_s"), (int, float))]
    warm = [w for w in (warmup_seconds(r) for r in reports.values()) if w is not None]
    out: dict[str, Any] = {"actors": len(reports)}
    # ready_s: actor created -> ready, as the driver saw it
    for name, values in (("ready_s", startup), ("load_s", load), ("warmup_s", warm)):
        mean, top = _stats(values)
        out[f"{name}_mean"], out[f"{name}_max"] = round(mean, 3), round(top, 3)
    return {**out, "per_worker": reports}


def _status(shards_failed: bool, shards_left: bool, counts: OutputCounts) -> str:
    if shards_failed or shards_left:  # shards left without failing: should not happen
        return FAILED
    if counts.images_failed or counts.rows_failed:
        return COMPLETED_WITH_FAILURES
    return SUCCEEDED


@dataclass(frozen=True)
class RunOutcome:
    """One run as its summary reports it: the shards it is over (a plain job's plan, or one
    incremental run's), those committed before it (not dispatched), their planned {'shards',
    'rows', 'images'}, dispatch's result (None: nothing dispatched), progress, and timings."""

    shards: Sequence[ShardSpec]
    committed_before: frozenset[int]
    fingerprint: str
    planned: Mapping[str, int]
    dispatch: DispatchResult | None
    progress: JobProgress
    timings: Mapping[str, float]
    gpus_per_actor: float = 0.0  # workers.gpus as dispatch resolved it
    cost: CostConfig = field(default_factory=CostConfig)


def build_summary(
    output: str, run: RunOutcome, counts: OutputCounts, near_duplicates: dict[str, Any] | None = None
) -> JobSummary:
    """Assemble the summary. counts and near_duplicates (driver.output.near_duplicate_counts;
    None: none counted): over every committed shard of the output."""
    dispatch, workers = run.dispatch, run.progress.workers.values()
    failed = [
        {"shard": f.index, "attempts": f.attempts, "kind": f.kind, "error": f.error}
        for f in (dispatch.failed if dispatch else [])
    ]
    planned, committed, before = run.planned, counts.shards, len(run.committed_before)
    reports = run.progress.startup_costs()
    made = sum(w.images_ok for w in workers)
    fleet = dispatch.fleet(made) if dispatch else {}
    return JobSummary(
        status=_status(bool(failed), committed < planned["shards"], counts),
        output=output,
        fingerprint=run.fingerprint,
        shards={
            "planned": planned["shards"],
            "committed": committed,
            "committed_before": before,
            "committed_now": committed - before,
            "failed": len(failed),
            "left": planned["shards"] - committed,
        },
        rows={"planned": planned["rows"], "ok": counts.rows_ok, "failed": counts.rows_failed},
        images={"planned": planned["images"], "ok": counts.images_ok, "failed": counts.images_failed},
        failures_by_error=_failures_by_error(counts, failed),
        failed_shards=failed,
        timings=_timings(run),
        startup=startup_summary(reports),
        workers={w: stats.to_dict() for w, stats in run.progress.workers.items()},
        dispatch=asdict(dispatch.stats) if dispatch else {},
        recompiles=sum(w.recompiles for w in workers),
        oom_splits=sum(w.oom_splits for w in workers),
        attention=attention_summary([w.attention for w in workers]),
        compile_fallbacks={w: fb for w, r in reports.items() if (fb := compile_fallbacks(r))},
        step_cache=step_cache_summary(counts.dit_blocks_computed, counts.dit_blocks_reused),
        quality_gate=gate_with_cost(counts.gate(), fleet),
        near_duplicates=near_duplicates or {},
        fleet=fleet,
        cost=cost_summary(
            counts.images_by_bucket,
            counts.generate_s_by_bucket,
            fleet,
            made,
            run.gpus_per_actor,
            run.cost.gpu_hour_usd,
        ),
    )


def _failures_by_error(counts: OutputCounts, failed: list[dict[str, Any]]) -> dict[str, int]:
    """The manifests' image errors, then the shards that failed, by kind."""
    failures = counts.errors_capped()
    for f in failed:
        key = f"shard failed: {f['kind']}"
        failures[key] = failures.get(key, 0) + 1
    return failures


def _timings(run: RunOutcome) -> dict[str, float]:
    """The run's timings, the workers' summed generate, encode and upload time, the actors' ready
    and busy time."""
    workers, dispatch = run.progress.workers.values(), run.dispatch
    return {
        **{k: round(v, 3) for k, v in run.timings.items()},
        **{k: round(sum(getattr(w, k) for w in workers), 3) for k in ("generate_s", "encode_s", "upload_s")},
        "actor_ready_s": round(dispatch.ready_actor_s, 3) if dispatch else 0.0,
        "actor_busy_s": round(dispatch.busy_actor_s, 3) if dispatch else 0.0,
    }


def gate_with_cost(gate: dict[str, Any], fleet: dict[str, Any]) -> dict[str, Any]:
    """The gate's counts with what its retries cost: `retry_share`, the tries beyond each image's
    first over all tries (every try is one image's work at the same size and steps), and, with a
    fleet account, that share of its generating hours (`retry_gpu_hours` or `retry_actor_hours`)."""
    if not gate:
        return gate
    out = {**gate, "retry_share": round(1 - 1 / gate["tries_per_image"], 4)}
    unit = "gpu" if "gpu_hours" in fleet else "actor"
    if f"generating_{unit}_hours" in fleet:
        out[f"retry_{unit}_hours"] = round(fleet[f"generating_{unit}_hours"] * out["retry_share"], 4)
    return out


def fleet_line(fleet: dict[str, Any]) -> str:
    """'12.5 GPU hours (start-up 1.2, generating 10.9, idle 0.4), 118.3 images per GPU hour'; under
    an hour in minutes and seconds: '1m52s of actor time (start-up 40s, generating 1m05s, idle 7s)'."""
    unit = "gpu" if "gpu_hours" in fleet else "actor"
    label = "GPU" if unit == "gpu" else "actor"
    total = fleet.get(f"{unit}_hours", 0.0)
    parts = ", ".join(
        f"{k} {fleet.get(f'{k}_{unit}_hours', 0.0):.1f}" for k in ("startup", "generating", "idle")
    )
    rate = fleet.get(f"images_per_{unit}_hour", 0.0)
    if total < 1.0:  # a small job: "0.0 actor hours (0.0, 0.0, 0.0)" says nothing; in time instead
        parts = ", ".join(
            f"{k} {format_duration(fleet.get(f'{k}_{unit}_hours', 0.0) * 3600)}"
            for k in ("startup", "generating", "idle")
        )
        spent = f"{format_duration(total * 3600)} of {label} time"
    else:
        spent = f"{total:.1f} {label} hours"
    return (
        f"{spent} over {fleet.get('actors', 0)} actors ({parts.replace('startup', 'start-up')}), "
        f"{rate:.1f} images per {label} hour"
    )


def step_cache_summary(computed: int, reused: int) -> dict[str, Any]:
    """The job's share of reused DiT work; {} when no image used a step cache."""
    if computed <= 0:
        return {}
    return {
        "blocks_computed": computed,
        "blocks_reused": reused,
        "reused_share": round(reused / (computed + reused), 4),
        "work_speedup": round((computed + reused) / computed, 3),
    }
