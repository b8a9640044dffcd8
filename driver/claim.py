"""Claiming an output for a job: `_job.json`, written create-only, says which job an output
belongs to; a job whose fingerprint differs is refused with what differs, so an output never
mixes images of two settings.

A plain job's fingerprint covers its settings and its input files (driver.plan); an incremental
job's covers its settings alone, since its input grows from run to run (driver.increment).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from typing import Any

from driver.plan import (
    JobPlan,
    PlanConfig,
    describe_differences,
    fingerprint_of,
    job_document,
    runtime_versions,
    settings_doc,
)
from driver.status import read_json
from workers.output.layout import job_key
from workers.output.manifest import committed_shards
from workers.storage import ObjectStore


class OutputMismatch(ValueError):
    """The output holds another job's results (different fingerprint) or is not a job output."""


def claim_output(store: ObjectStore, plan: JobPlan, resolved_spec: dict[str, Any]) -> bool:
    """Make `store` this plan's output: write `_job.json` create-only, or check the one there.

    Returns True when the output already belonged to this plan (a resume). Raises OutputMismatch
    naming what differs when it belongs to another job.
    """
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return _claim(
        store,
        plan.fingerprint(),
        plan.fingerprint_doc(),
        lambda: job_document(plan, resolved_spec, created_at=created),
        "run with the settings and input it was made with",
    )


def claim_incremental_output(
    store: ObjectStore, config: PlanConfig, source: str, resolved_spec: dict[str, Any], write: bool = True
) -> str:
    """`claim_output` for an incremental job: `_job.json` holds the settings fingerprint only
    (the input grows). Returns the fingerprint; raises OutputMismatch naming what differs.
    write=False only checks (`ditfleet plan`): an output without `_job.json` stays as it is."""
    doc = settings_doc(config, incremental=True)
    fingerprint = fingerprint_of(doc)

    def job_doc() -> dict[str, Any]:
        return {
            "version": 1,
            "spec": dict(resolved_spec),
            "fingerprint": fingerprint,
            "fingerprint_doc": doc,
            "plan": {"source": source, "incremental": True, "shard_size": config.shard_size},
            "versions": runtime_versions(),
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }

    _claim(store, fingerprint, doc, job_doc, "run with the settings it was made with", write)
    return fingerprint


def _claim(
    store: ObjectStore,
    fingerprint: str,
    fingerprint_doc: Mapping[str, Any],
    job_doc: Callable[[], dict[str, Any]],
    or_else: str,
    write: bool = True,
) -> bool:
    where = store.uri()
    existing = read_json(store, job_key())
    if existing is None and not write:
        return False
    if existing is None:
        if committed_shards(store):
            raise OutputMismatch(
                f"output {where} has shard manifests but no _job.json, so it cannot be checked against "
                "this job. Choose a new output, or restore its _job.json"
            )
        if store.put_if_absent(
            job_key(), (json.dumps(job_doc(), indent=2) + "\n").encode(), "application/json"
        ):
            return False
        existing = read_json(store, job_key())  # another driver claimed it just now
        assert existing is not None
    if existing.get("fingerprint") == fingerprint:
        return True
    old = existing.get("fingerprint_doc")
    if not isinstance(old, Mapping):
        differences = ["the existing _job.json has no fingerprint_doc (written by another version or tool)"]
    elif bool(old.get("incremental")) != bool(fingerprint_doc.get("incremental")):
        if old.get("incremental"):
            raise OutputMismatch(
                f"output {where} was made by an incremental job (input.incremental: true), which adds "
                "the new rows of a growing input run by run. Set input.incremental: true in this job "
                "too, or choose a new output"
            )
        raise OutputMismatch(
            f"output {where} was made by a job over a fixed input (input.incremental is not set), so "
            "an incremental job cannot add to it. Choose a new output for the incremental job"
        )
    else:
        differences = describe_differences(old, fingerprint_doc) or [
            "the fingerprint differs, but no listed setting does (fingerprint format changed)"
        ]
    listed = "\n".join(f"  - {d}" for d in differences)
    raise OutputMismatch(
        f"output {where} belongs to another job (its _job.json fingerprint differs):\n{listed}\n"
        f"Write to a new output, or {or_else}"
    )
