"""What an output holds, read from the output itself: `_job.json`, the manifests, `_SUCCESS`.

Used by `ditfleet status` and by the driver for its final counts: the manifests are the truth
(a shard committed by an earlier run, or by a twin of a speculative run, counts exactly as one
committed now). Each manifest is read on its own, only the columns counted, so memory stays
O(shards) whatever the number of rows. What was planned is in `_job.json`, or, for an
incremental job, in the union of its run records (driver.run_records).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.output.compact import CompactedState, compacted_state
from ditfleet.driver.output.job_file import read_job_file
from ditfleet.driver.output.lease import shard_ranges
from ditfleet.driver.output.near_duplicate_counts import near_duplicate_line, output_near_duplicates
from ditfleet.driver.output.success import success_file
from ditfleet.driver.run_records import RecordedPlan, read_run_records
from ditfleet.workers.output.manifest import current_manifest_keys, failure_reason
from ditfleet.workers.output.score_table import ScoreTables, all_score_tables
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import READ_THREADS
from ditfleet.workers.storage.parquet_bytes import read_parquet

_COLUMNS = ["id", "status", "error", "bucket", "generate_s"]
# The step cache's counts; absent from manifests written before it existed.
_STEP_CACHE_COLUMNS = ["dit_blocks_computed", "dit_blocks_reused"]
# The quality gate's record (quality.gate); absent from manifests written before it existed.
_GATE_COLUMNS = ["gate_passed", "gate_tries"]
# An edit job's sources (failure_reason takes them out of errors); absent from older manifests.
_SOURCE_COLUMNS = ["source_uris"]
MAX_ERROR_KINDS = 20  # distinct error messages kept in counts; the rest are summed as "other"


@dataclass
class OutputCounts:
    """Rows and images of a set of committed shards. A row is ok when all its images are."""

    shards: int = 0
    rows_ok: int = 0
    rows_failed: int = 0
    images_ok: int = 0
    images_failed: int = 0
    errors: Counter = field(default_factory=Counter)  # failure_reason of the error -> images
    # DiT block evaluations of the images a step cache served (sampling.step_cache), summed.
    dit_blocks_computed: int = 0
    dit_blocks_reused: int = 0
    # quality.gate: images it judged, those that passed, and the tries they took in all.
    gate_images: int = 0
    gate_passed: int = 0
    gate_tries: int = 0
    # Images and their summed generate_s (every try's) by bucket: what an image costs (driver.output.cost).
    images_by_bucket: dict[str, int] = field(default_factory=dict)
    generate_s_by_bucket: dict[str, float] = field(default_factory=dict)

    def add(self, other: OutputCounts) -> None:
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, dict):  # errors, and the by-bucket sums
                for key, value in getattr(other, f.name).items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def gate(self) -> dict[str, Any]:
        """The gate's pass rate and tries per image over the images it judged; {} without a gate."""
        if not self.gate_images:
            return {}
        return {
            "images": self.gate_images,
            "passed": self.gate_passed,
            "pass_rate": round(self.gate_passed / self.gate_images, 4),
            "tries_per_image": round(self.gate_tries / self.gate_images, 3),
        }

    def errors_capped(self, limit: int = MAX_ERROR_KINDS) -> dict[str, int]:
        top = self.errors.most_common(limit)
        rest = sum(self.errors.values()) - sum(n for _, n in top)
        return dict(top) | ({"other": rest} if rest else {})


def shard_counts(store: ObjectStore, key: str) -> OutputCounts:
    """Counts of one committed shard from its current manifest at `key` (3 columns read)."""
    table = read_parquet(
        store.get(key), _COLUMNS, if_present=_STEP_CACHE_COLUMNS + _GATE_COLUMNS + _SOURCE_COLUMNS
    )
    present = table.column_names
    blocks = {c: (pc.sum(table.column(c)).as_py() or 0) if c in present else 0 for c in _STEP_CACHE_COLUMNS}
    ok = pc.equal(table.column("status"), "ok")
    images_ok = pc.sum(ok).as_py() or 0
    # A row is failed when any of its images failed: group the failed images by id.
    failed_ids = pc.unique(pc.filter(table.column("id"), pc.invert(ok)))
    all_ids = pc.count_distinct(table.column("id")).as_py()
    failed = table.filter(pc.invert(ok))
    sources = failed.column("source_uris").to_pylist() if "source_uris" in present else [None] * len(failed)
    errors = Counter(failure_reason(e, u) for e, u in zip(failed.column("error").to_pylist(), sources) if e)
    images, seconds = _by_bucket(table)
    return OutputCounts(
        shards=1,
        rows_ok=all_ids - len(failed_ids),
        rows_failed=len(failed_ids),
        images_ok=images_ok,
        images_failed=table.num_rows - images_ok,
        errors=errors,
        images_by_bucket=images,
        generate_s_by_bucket=seconds,
        **blocks,
        **(gate_counts(table) if "gate_passed" in present else {}),
    )


def _by_bucket(table: pa.Table) -> tuple[dict[str, int], dict[str, float]]:
    """A manifest's images and their generate_s (null: 0) by bucket."""
    images: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for bucket, s in zip(table.column("bucket").to_pylist(), table.column("generate_s").to_pylist()):
        images[bucket] = images.get(bucket, 0) + 1
        seconds[bucket] = seconds.get(bucket, 0.0) + (s or 0.0)
    return images, seconds


def gate_counts(table: pa.Table) -> dict[str, int]:
    """The gate's counts of manifest rows (OutputCounts' gate_* fields): the images it judged (a
    gate_passed that is not null), those that passed, and their tries."""
    judged = pc.is_valid(table.column("gate_passed"))
    passed = pc.filter(table.column("gate_passed"), judged)
    tries = pc.filter(table.column("gate_tries"), judged)
    return {
        "gate_images": len(passed),
        "gate_passed": pc.sum(passed).as_py() or 0,
        "gate_tries": pc.sum(tries).as_py() or 0,
    }


def count_shards(store: ObjectStore, shards: Iterable[int], threads: int = READ_THREADS) -> OutputCounts:
    """Counts of committed `shards`; a committed shard stays committed (a manifest key is never
    freed), so one listing after the caller's has each one's current manifest."""
    total = OutputCounts()
    shards = list(shards)
    if not shards:
        return total
    current = current_manifest_keys(store)  # one listing for all: a redo's generation counts
    with ThreadPoolExecutor(max_workers=min(threads, len(shards))) as pool:
        for counts in pool.map(lambda s: shard_counts(store, current[s]), shards):
            total.add(counts)
    return total


@dataclass
class OutputStatus:
    """An output as `ditfleet status` shows it."""

    uri: str
    job: dict[str, Any] | None  # _job.json
    success: dict[str, Any] | None  # _SUCCESS
    committed: list[int]
    missing: list[int]  # planned shards without a manifest (empty when there is no _job.json)
    counts: OutputCounts
    # Incremental jobs: {shards, rows, images} over every run's live shards, and the runs.
    recorded: dict[str, int] | None = None
    stale_success: str | None = None  # why a `_SUCCESS` there is not believed (driver.output.success)
    compacted: CompactedState = CompactedState(False, False)
    # Near duplicates among the committed images (driver.output.near_duplicate_counts); {}
    # when no manifest has a phash (an output older than the column).
    near_duplicates: dict[str, Any] = field(default_factory=dict)
    # `ditfleet score`'s tables, per scorer that has any: a redo leaves its shards behind.
    score_tables: list[ScoreTables] = field(default_factory=list)

    @property
    def plan(self) -> dict[str, Any]:
        return self.recorded if self.recorded is not None else ((self.job or {}).get("plan") or {})

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        c = self.counts
        return {
            "output": self.uri,
            "fingerprint": (self.job or {}).get("fingerprint"),
            "complete": self.success is not None and not self.missing,
            "shards": {
                "planned": plan.get("shards"),
                "committed": len(self.committed),
                "left": len(self.missing),
            },
            "rows": {"planned": plan.get("rows"), "ok": c.rows_ok, "failed": c.rows_failed},
            "images": {"planned": plan.get("images"), "ok": c.images_ok, "failed": c.images_failed},
            "failures_by_error": c.errors_capped(),
            "quality_gate": c.gate(),
            "near_duplicates": self.near_duplicates,
            "shards_left": _ranges(self.missing),
            "stale_success": self.stale_success,
            "compacted": self.compacted.describe(),
            "score_tables": {
                t.scorer: {
                    "scored": len(t.made),
                    "manifests": len(self.committed),
                    "stale": {str(shard): list(gens) for shard, gens in sorted(t.stale.items())},
                    "unscored": list(t.unscored),
                }
                for t in self.score_tables
            },
            **({"runs": self.recorded["runs"]} if self.recorded is not None else {}),
        }

    def format_text(self) -> str:
        d = self.to_dict()
        s, r, i = d["shards"], d["rows"], d["images"]
        state = "complete" if d["complete"] else ("not started" if not self.committed else "incomplete")
        runs = f" ({d['runs']} incremental runs)" if "runs" in d else ""
        lines = [
            f"output {self.uri}: {state}{runs}",
            f"  shards: {s['committed']} committed of {_or_unknown(s['planned'])}, {s['left']} left",
            f"  rows:   {r['ok']} ok, {r['failed']} failed (of {_or_unknown(r['planned'])} planned)",
            f"  images: {i['ok']} ok, {i['failed']} failed (of {_or_unknown(i['planned'])} planned)",
        ]
        if self.stale_success:
            lines.append(f"  note: {self.stale_success}")
        if d["shards_left"]:
            lines.append(f"  shards left: {d['shards_left']}")
        if d["quality_gate"]:
            lines.append(f"  quality gate: {gate_line(d['quality_gate'])}")
        if self.near_duplicates:
            lines.append(f"  near duplicates: {near_duplicate_line(self.near_duplicates)}")
        lines.extend(f"  failed x{n}: {message}" for message, n in d["failures_by_error"].items())
        if self.compacted.present:
            lines.append(f"  compacted set: {d['compacted']}")
        for t in self.score_tables:
            note = t.note(self.uri)
            lines.append(
                f"  scores/{t.scorer}/: {len(t.made)} of {len(self.committed)} shard manifests scored"
                + (f"; STALE: {note}" if note else " (current)")
            )
        if self.job is None:
            lines.append("  (no _job.json: not a ditfleet output, or no run got past planning)")
        return "\n".join(lines)


def gate_line(gate: dict[str, Any]) -> str:
    """'45/48 images passed (93.8%), 1.15 tries per image' and, where the summary gave them, what
    the retries cost: '; retries 13.0% of the generating work (0.4 GPU hours)'."""
    line = (
        f"{gate['passed']}/{gate['images']} images passed ({gate['pass_rate']:.1%}), "
        f"{gate['tries_per_image']:.2f} tries per image"
    )
    if "retry_share" in gate:
        line += f"; retries {gate['retry_share']:.1%} of the generating work"
        for unit, label in (("gpu", "GPU"), ("actor", "actor")):
            if f"retry_{unit}_hours" in gate:
                line += f" ({gate[f'retry_{unit}_hours']:.2f} {label} hours)"
    return line


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _ranges(shards: list[int], limit: int = 20) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (at most `limit` ranges, then '...')."""
    ranges = shard_ranges(shards)
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in ranges[:limit]]
    return ", ".join(shown) + (", ..." if len(ranges) > limit else "")


def output_status(store: ObjectStore) -> OutputStatus:
    """Read what `store` (an output root) holds."""
    job = read_job_file(store)
    planned = (job or {}).get("plan") or {}
    current = current_manifest_keys(store)
    committed = sorted(current)
    have = set(committed)
    recorded = None
    if planned.get("incremental"):
        plan = RecordedPlan.of(read_run_records(store))
        live = plan.live()
        recorded = {
            "shards": len(live),
            "rows": sum(s.num_rows for s in live),
            "images": sum(s.num_images for s in live),
            "runs": len(plan.records),
        }
        missing = [s.index for s in live if s.index not in have]
    else:
        shards = planned.get("shards")
        missing = [s for s in range(shards) if s not in have] if isinstance(shards, int) else []
    success = success_file(store)
    return OutputStatus(
        uri=store.uri(),
        job=job,
        success=success.doc,
        stale_success=success.stale,
        committed=committed,
        missing=missing,
        counts=count_shards(store, committed),
        recorded=recorded,
        compacted=compacted_state(store, current),
        near_duplicates=output_near_duplicates(store, committed),
        score_tables=all_score_tables(store, current),
    )
