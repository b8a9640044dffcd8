"""verify's view of each shard: what the plan says it holds, what its committed manifest says,
and what one stored object holds.

Every result is a pure function of one shard's manifest or one object, so these run on threads of
the verifying process (ThreadChecks) or as Ray tasks (driver.output.verify_ray) and the report is
the same; only the whole-output checks (the listing, rows across manifests, orphans, `_SUCCESS`,
the compacted set) need driver.output.verify itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from ditfleet.driver.output.verify_report import VerifyReport
from ditfleet.driver.run_records import RecordedPlan, RunRecordError, read_run_records
from ditfleet.workers.output.formats import ManifestImage, StoredImageError, ok_images, reader_for_key
from ditfleet.workers.output.layout import job_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, with_later_columns
from ditfleet.workers.storage import ObjectNotFound, ObjectStore
from ditfleet.workers.storage.base import READ_THREADS
from ditfleet.workers.storage.parquet_bytes import read_parquet


@dataclass
class VerifyPlan:
    """What the plan says the output holds."""

    shards: set[int]
    rows: int | None  # totals (plain jobs); None when unknown
    images: int | None
    per_shard: dict[int, tuple[int, int]]  # shard -> (rows, images), where the plan says
    incremental: bool


def read_plan(store: ObjectStore, job: dict[str, Any], report: VerifyReport) -> VerifyPlan | None:
    """The plan of `_job.json` (or an incremental job's run records); None, said in `report`, if unreadable."""
    plan = job.get("plan") or {}
    if plan.get("incremental"):
        try:
            recorded = RecordedPlan.of(read_run_records(store))
        except RunRecordError as e:
            report.problems.append(str(e))
            return None
        live = recorded.live()
        return VerifyPlan(
            {s.index for s in live},
            sum(s.num_rows for s in live),
            sum(s.num_images for s in live),
            {s.index: (s.num_rows, s.num_images) for s in live},
            True,
        )
    shards = plan.get("shards")
    if not isinstance(shards, int) or shards < 0:
        report.problems.append(f"{store.uri(job_key())} has no plan.shards: was it written by ditfleet?")
        return None
    return VerifyPlan(set(range(shards)), plan.get("rows"), plan.get("images"), {}, False)


@dataclass
class CommittedShard:
    """What one committed manifest says."""

    shard: int
    ids: pa.Array
    ks: pa.Array
    ok: list[ManifestImage]
    failed: int
    # The attempt tokens the ok rows' objects carry (the committed run's, one in practice), and
    # whether every ok row's uri is an attempt object of this shard: only then can an object of
    # the shard be proved to be another run's.
    tokens: set[str] = field(default_factory=set)
    accounted: bool = True


def _read_manifest(
    store: ObjectStore, shard: int, key: str, plan: VerifyPlan
) -> tuple[CommittedShard | None, list[str]]:
    """What the manifest at `key` says, and its problems: the schema, rows of `shard` only, each
    (id, k) once, as many rows and images as the plan gives the shard."""
    where = store.uri(key)
    try:
        table = with_later_columns(read_parquet(store.get(key)))
    except Exception as e:  # noqa: BLE001 - a damaged manifest is a finding, not a crash
        return None, [f"{where}: cannot be read as Parquet ({type(e).__name__}: {e})"]
    if not table.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
        return None, [f"{where}: not the manifest schema (another ditfleet version or a foreign file)"]
    problems = []
    shards = set(table.column("shard").to_pylist())
    if shards != {shard}:
        problems.append(f"{where}: holds rows of shards {sorted(shards)}, not only {shard}")
    pairs = Counter(zip(table.column("id").to_pylist(), table.column("k").to_pylist()))
    for (id_, k), n in pairs.items():
        if n > 1:
            problems.append(f"{where}: row id={id_!r} k={k} appears {n} times")
    per_id = Counter(table.column("id").to_pylist())
    if shard in plan.per_shard:
        rows, images = plan.per_shard[shard]
        if len(per_id) != rows or table.num_rows != images:
            problems.append(
                f"{where}: {len(per_id)} rows / {table.num_rows} images, the plan has {rows} / {images}"
            )
    ok = ok_images(table, per_id)
    return CommittedShard(
        shard, table.column("id"), table.column("k"), ok, table.num_rows - len(ok)
    ), problems


def _check_object(store: ObjectStore, key: str, rows: list[ManifestImage]) -> list[str]:
    """Problems of one stored object against the ok manifest rows that name it, read through
    its format's reader."""
    try:
        stored = reader_for_key(key).read(store, key, rows)
    except ObjectNotFound:
        return [f"{store.uri(key)}: missing (named by {len(rows)} ok manifest rows)"]
    except StoredImageError as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - whatever one object does, it is one finding
        return [f"{store.uri(key)}: cannot be read ({type(e).__name__}: {e})"]
    return [p for p in map(stored.problem, rows) if p] + stored.unnamed_problems()


def read_manifest_group(
    store: ObjectStore, items: list[tuple[int, str]], plan: VerifyPlan, workers: int
) -> list[tuple[CommittedShard | None, list[str]]]:
    """(what the manifest says, its problems) for each (shard, manifest key), in order, on
    `workers` threads."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda item: _read_manifest(store, item[0], item[1], plan), items))


def check_object_group(
    store: ObjectStore, items: list[tuple[str, list[ManifestImage]]], workers: int
) -> list[list[str]]:
    """The problems of each (key, the ok rows naming it), in order, on `workers` threads."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda item: _check_object(store, *item), items))


class ShardChecks(Protocol):
    """Where the per-shard checks run (see the module docstring): `run` returns
    check(store, items, *args, threads), `check` being read_manifest_group or check_object_group."""

    def run(self, check: Callable[..., list], store: ObjectStore, items: list, *args: Any) -> list: ...


@dataclass
class ThreadChecks:
    """The per-shard checks on threads of this process (the default)."""

    workers: int = READ_THREADS  # verify_output passes store.read_threads() unless told

    def run(self, check, store, items, *args):
        return check(store, items, *args, self.workers)
