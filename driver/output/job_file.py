"""`_job.json`, the file that says which job an output belongs to; this module owns it.

What it holds (one version for plain and incremental jobs):

    version          JOB_FILE_VERSION
    spec             the resolved job spec (every default filled in), so an output says how it was made
    fingerprint      sha256 of fingerprint_doc (driver.plan.fingerprint_of)
    fingerprint_doc  what the fingerprint covers: the settings that change pixels and, for a plain
                     job, the identity of every input file (an incremental job's input grows, so
                     its fingerprint covers the settings alone, with "incremental": true)
    plan             totals of a plain job's plan; an incremental job's source and shard size
    versions         python, ditfleet, torch, pyarrow
    created_at       when the output was claimed (UTC, ISO 8601)
    input_columns    per input file of a plain job, its columns in file order and a digest of each
                     one's record in the footer (`input_columns`): outside the fingerprint, only
                     to say what changed when a file's footer differs (column order, or a column)

It is written once, create-only (`write_job_file`): of two drivers claiming the same output, one
wins and the other reads what won. `read_job_file` reads it back, `fingerprint_differences` says in
words how a new job differs from the one on disk. The claim policy (when to write, when to refuse)
is driver.output.claim's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import platform
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.output.json_objects import read_json
from ditfleet.driver.plan import JobPlan, PlanConfig, fingerprint_of, settings_doc
from ditfleet.workers.output.layout import job_key
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import read_each

JOB_FILE_VERSION = 1
_RESTORE = "Restore it from a backup, or write to a new output"


class OutputMismatch(ValueError):
    """The output holds another job's results (different fingerprint) or is not a job output."""


def runtime_versions() -> dict[str, str]:
    """Versions that can change the images or the output format."""
    out = {"python": platform.python_version()}
    for dist in ("ditfleet", "torch", "pyarrow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _document(
    spec: Mapping[str, Any],
    fingerprint_doc: Mapping[str, Any],
    plan: dict[str, Any],
    versions: Mapping[str, str] | None,
) -> dict[str, Any]:
    return {
        "version": JOB_FILE_VERSION,
        "spec": dict(spec),
        "fingerprint": fingerprint_of(fingerprint_doc),
        "fingerprint_doc": dict(fingerprint_doc),
        "plan": plan,
        "versions": dict(versions) if versions is not None else runtime_versions(),
    }


def job_document(
    plan: JobPlan,
    resolved_spec: Mapping[str, Any],
    versions: Mapping[str, str] | None = None,
    columns: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `_job.json` of a plain job: its spec, the plan's fingerprint and totals, versions;
    columns: its input files' `input_columns`."""
    totals = {
        "source": plan.source,
        "files": len(plan.inputs),
        "rows": plan.total_rows,
        "images": plan.total_images,
        "shards": len(plan.shards),
        "shard_size": plan.config.shard_size,
        "buckets_used": list(plan.buckets_used),
        "empty_files": list(plan.empty_files),
    }
    doc = _document(resolved_spec, plan.fingerprint_doc(), totals, versions)
    return doc if columns is None else {**doc, "input_columns": dict(columns)}


def input_columns(source: PromptSource, uris: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per input file (footers only): "order", its columns in file order, and "columns", per
    column a digest of what the footer records of it in every row group (type, values, nulls,
    min and max, uncompressed size): a column rewritten with other values mostly changes it, a
    reordered one does not. A file that cannot be read is left out."""

    def of(uri: str) -> tuple[str, dict[str, Any] | None]:
        try:
            meta = source.open(uri).metadata
        except (OSError, ValueError):
            return uri, None
        columns: dict[str, Any] = {}
        for i in range(meta.num_columns):
            parts = []
            for g in range(meta.num_row_groups):
                chunk = meta.row_group(g).column(i)
                stats = chunk.statistics
                seen = (
                    (stats.null_count, stats.min, stats.max)
                    if stats is not None and stats.has_min_max
                    else ()
                )
                parts.append(
                    repr((chunk.physical_type, chunk.num_values, chunk.total_uncompressed_size, seen))
                )
            name = meta.schema.column(i).path
            columns[name] = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        return uri, {"order": list(columns), "columns": columns}

    return {uri: doc for uri, doc in read_each(of, list(uris)) if doc is not None}


def incremental_job_document(
    config: PlanConfig,
    source: str,
    resolved_spec: Mapping[str, Any],
) -> dict[str, Any]:
    """The `_job.json` of an incremental job: the settings fingerprint only (its runs record
    their shards in `_runs/`, driver.run_records)."""
    plan = {"source": source, "incremental": True, "shard_size": config.shard_size}
    return _document(resolved_spec, settings_doc(config, incremental=True), plan, None)


def write_job_file(store: ObjectStore, doc: Mapping[str, Any]) -> bool:
    """Write `_job.json` create-only, stamped with the time unless `doc` has one. False: the
    output has one already (nothing written)."""
    created_at = doc.get("created_at") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    data = json.dumps({**doc, "created_at": created_at}, indent=2) + "\n"
    return store.put_if_absent(job_key(), data.encode(), "application/json")


def read_job_file(store: ObjectStore) -> dict[str, Any] | None:
    """The output's `_job.json` as written, or None when there is none. Raises OutputMismatch
    naming the file when it is not a JSON object (damaged, or written by another tool)."""
    try:
        return read_json(store, job_key())
    except ValueError as e:
        raise OutputMismatch(f"{e}. {_RESTORE}") from e


def check_job_file(store: ObjectStore, doc: Mapping[str, Any]) -> None:
    """Refuse a `_job.json` that this ditfleet cannot compare a job with, naming the file."""
    where = store.uri(job_key())
    version = doc.get("version")
    if version != JOB_FILE_VERSION:
        if isinstance(version, int) and version > JOB_FILE_VERSION:
            raise OutputMismatch(
                f"{where} has version {version}; this ditfleet reads version {JOB_FILE_VERSION}. "
                "Run the job with the ditfleet version that made the output, or write to a new output"
            )
        raise OutputMismatch(
            f"{where} is not a ditfleet job file (version {version!r}, expected {JOB_FILE_VERSION}): "
            f"it was written by another tool, or damaged. {_RESTORE}"
        )
    for key, kind in (("fingerprint", str), ("fingerprint_doc", Mapping)):
        if not isinstance(doc.get(key), kind):
            raise OutputMismatch(
                f"{where} has no valid {key!r}, so this job cannot be checked against it. {_RESTORE}"
            )


def fingerprint_differences(
    existing: Mapping[str, Any],
    fingerprint: str,
    fingerprint_doc: Mapping[str, Any],
    columns_now: Mapping[str, Any] | None = None,
) -> list[str]:
    """Why an existing (checked) `_job.json` does not belong to the job with this fingerprint, in
    words; empty when it does. columns_now: `input_columns` of the input files now, to say what
    changed in a file whose footer differs (the existing file's `input_columns` are the then)."""
    if existing.get("fingerprint") == fingerprint:
        return []
    columns = (existing.get("input_columns") or {}, columns_now or {})
    return describe_differences(existing["fingerprint_doc"], fingerprint_doc, columns) or [
        "the fingerprint differs, but no listed setting does (fingerprint format changed)"
    ]


def describe_differences(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    columns: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {}),
) -> list[str]:
    """'job_seed: 1 in the existing output, 2 now', 'input file ... was added', ... between two
    fingerprint docs. columns: the files' `input_columns` then and now, where known."""
    out = _setting_differences(old, new)
    old_in = {i["uri"]: i for i in old.get("inputs") or []}
    new_in = {i["uri"]: i for i in new.get("inputs") or []}
    for uri in new_in.keys() - old_in.keys():
        out.append(f"input file {uri} was added")
    for uri in old_in.keys() - new_in.keys():
        out.append(f"input file {uri} was removed")
    # A file's content digest is over its shards' digests: comparable under one shard size only.
    same_cut = old.get("shard_size") == new.get("shard_size")
    for uri in sorted(old_in.keys() & new_in.keys()):
        a, b = old_in[uri], new_in[uri]
        changes = [f"{k} {a.get(k)} -> {b.get(k)}" for k in ("size", "rows") if a.get(k) != b.get(k)]
        if a.get("footer_sha256") != b.get("footer_sha256"):
            digests = a.get("content_digest"), b.get("content_digest")
            same_values = None if not same_cut or None in digests else digests[0] == digests[1]
            changes.extend(_footer_changes(columns[0].get(uri), columns[1].get(uri), same_values))
        elif a.get("content_digest") != b.get("content_digest") and same_cut:
            changes.append(
                f"rows edited in place: content digest {a.get('content_digest')} -> {b.get('content_digest')}, "
                "same size, rows and footer"
            )
        if changes:
            out.append(f"input file {uri} changed ({', '.join(changes)})")
    if old_in.keys() == new_in.keys() and list(old_in) != list(new_in):
        out.append("input files are in a different order (rows without an id would get other ids)")
    return out


def _footer_changes(
    then: Mapping[str, Any] | None, now: Mapping[str, Any] | None, same_values: bool | None
) -> list[str]:
    """What changed in a file whose footer differs, as far as its `input_columns` and the content
    digests tell (same_values: whether the rows' values are the same; None: not known)."""
    same = {True: ["the rows' values are the same"], False: [], None: []}[same_values]
    if not then or not now:  # an output made before columns were recorded
        return ["its footer differs", *same] if same_values else ["content differs"]
    out = [f"column {c!r} was added" for c in now["order"] if c not in then["columns"]]
    out += [f"column {c!r} was removed" for c in then["order"] if c not in now["columns"]]
    edited = [c for c in now["order"] if c in then["columns"] and then["columns"][c] != now["columns"][c]]
    if not same_values:
        out += [f"values of column {c!r} changed" for c in edited]
    kept_then = [c for c in then["order"] if c in now["columns"]]
    kept_now = [c for c in now["order"] if c in then["columns"]]
    if kept_then != kept_now:
        out.append(f"column order changed: {kept_then} -> {kept_now}")
    if same_values is False and not out:
        out.append("values changed in place, in a column its footer does not tell apart")
    return (out or ["its footer differs"]) + same


def _setting_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key in sorted((set(old) | set(new)) - {"inputs", "image_settings"}):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)!r} in the existing output, {new.get(key)!r} now")
    old_img, new_img = old.get("image_settings") or {}, new.get("image_settings") or {}
    for key in sorted(set(old_img) | set(new_img)):
        if old_img.get(key) != new_img.get(key):
            out.append(
                f"image_settings.{key}: {old_img.get(key)!r} in the existing output, {new_img.get(key)!r} now"
            )
    return out
