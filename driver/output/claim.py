"""Claiming an output for a job: `_job.json` (driver.output.job_file), written create-only, says which
job an output belongs to; a job whose fingerprint differs is refused with what differs, so an
output never mixes images of two settings.

A plain job's fingerprint covers its settings and its input files (driver.plan); an incremental
job's covers its settings alone, since its input grows from run to run (driver.increment). Both
cover the model's bytes when the driver can identify them (workers.weights.digest): the
fingerprint holds their digest as `model_weights` and `_job.json` each file's identity under
`model`, so a resume with other weights at the same path is refused naming the file that changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.output.job_file import (
    OutputMismatch,
    check_job_file,
    fingerprint_differences,
    incremental_job_document,
    input_columns,
    job_document,
    read_job_file,
    write_job_file,
)
from ditfleet.driver.plan import JobPlan, PlanConfig, fingerprint_of, settings_doc
from ditfleet.workers.output.manifest import committed_shards
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.weights.digest import ModelIdentity, changed_files


def claim_output(
    store: ObjectStore,
    plan: JobPlan,
    resolved_spec: dict[str, Any],
    model: ModelIdentity | None = None,
    source: PromptSource | None = None,
) -> bool:
    """Make `store` this plan's output: write `_job.json` create-only, or check the one there.

    Returns True when the output already belonged to this plan (a resume). Raises OutputMismatch
    naming what differs when it belongs to another job. model: the identity of the model's bytes.
    source: the plan's input, whose footers `_job.json` records per column (job_file.input_columns)
    so that a refusal says what changed in a file whose footer differs.
    """
    uris = [i.uri for i in plan.inputs]
    return _claim(
        store,
        plan.fingerprint_doc(),
        lambda: job_document(plan, resolved_spec, columns=input_columns(source, uris) if source else None),
        "run with the settings and input it was made with",
        model=model,
        columns_now=(lambda changed: input_columns(source, changed)) if source else None,
    )


def _with_model(fingerprint_doc: Mapping[str, Any], model: ModelIdentity | None) -> dict[str, Any]:
    return dict(fingerprint_doc) if model is None else {**fingerprint_doc, "model_weights": model.digest}


def _job_with_model(
    job: dict[str, Any], fingerprint_doc: dict[str, Any], model: ModelIdentity | None
) -> dict[str, Any]:
    if model is None:
        return job
    return {
        **job,
        "fingerprint": fingerprint_of(fingerprint_doc),
        "fingerprint_doc": fingerprint_doc,
        "model": model.to_dict(),
    }


def claim_incremental_output(
    store: ObjectStore,
    config: PlanConfig,
    source: str,
    resolved_spec: dict[str, Any],
    write: bool = True,
    model: ModelIdentity | None = None,
) -> str:
    """`claim_output` for an incremental job: `_job.json` holds the settings fingerprint only
    (the input grows). Returns the fingerprint; raises OutputMismatch naming what differs.
    write=False only checks (`ditfleet plan`): an output without `_job.json` stays as it is."""
    doc = settings_doc(config, incremental=True)
    _claim(
        store,
        doc,
        lambda: incremental_job_document(config, source, resolved_spec),
        "run with the settings it was made with",
        write,
        model,
    )
    return fingerprint_of(_with_model(doc, model))


def _claim(
    store: ObjectStore,
    fingerprint_doc: Mapping[str, Any],
    job_doc: Callable[[], dict[str, Any]],
    or_else: str,
    write: bool = True,
    model: ModelIdentity | None = None,
    columns_now: Callable[[list[str]], dict[str, Any]] | None = None,
) -> bool:
    """claim_output's work; `fingerprint_doc` and `job_doc()` get the model's identity here.
    columns_now(uris): `input_columns` of those input files now (those whose footer changed)."""
    where = store.uri()
    fingerprint_doc = _with_model(fingerprint_doc, model)
    existing = read_job_file(store)
    if existing is None and not write:
        return False
    if existing is None:
        if committed_shards(store):
            raise OutputMismatch(
                f"output {where} has shard manifests but no _job.json, so it cannot be checked against "
                "this job. Choose a new output, or restore its _job.json"
            )
        if write_job_file(store, _job_with_model(job_doc(), fingerprint_doc, model)):
            return False
        existing = read_job_file(store)  # another driver claimed it just now
        assert existing is not None
    check_job_file(store, existing)
    _check_same_kind(where, existing["fingerprint_doc"], fingerprint_doc)
    if ("model_weights" in existing["fingerprint_doc"]) != ("model_weights" in fingerprint_doc):
        # One side does not know the model's bytes (an output made before they were recorded;
        # `ditfleet plan`, which reads no weights; a driver that cannot read the model warned
        # so): both are compared without them.
        existing_doc = _unweighed(existing["fingerprint_doc"])
        existing = {**existing, "fingerprint": fingerprint_of(existing_doc), "fingerprint_doc": existing_doc}
        fingerprint_doc = _unweighed(fingerprint_doc)
    if _undigested(existing["fingerprint_doc"]) and not _undigested(fingerprint_doc):
        # An output planned before input content was digested: compared by footers, as then
        # (its _job.json has no digest to compare with).
        fingerprint_doc = _without_content(fingerprint_doc)
    fingerprint = fingerprint_of(fingerprint_doc)
    if existing.get("fingerprint") == fingerprint:
        return True
    now = {}
    if columns_now is not None and existing.get("input_columns"):
        footers = {i["uri"]: i.get("footer_sha256") for i in existing["fingerprint_doc"].get("inputs") or []}
        changed = [
            i["uri"]
            for i in fingerprint_doc.get("inputs") or []
            if i["uri"] in footers and footers[i["uri"]] != i.get("footer_sha256")
        ]
        now = columns_now(changed)
    differences = fingerprint_differences(existing, fingerprint, fingerprint_doc, now)
    if not differences:
        return True
    differences = _name_changed_files(existing, model, differences)
    listed = "\n".join(f"  - {d}" for d in differences)
    raise OutputMismatch(
        f"output {where} belongs to another job (its _job.json fingerprint differs):\n{listed}\n"
        f"Write to a new output, or {or_else}"
    )


def _undigested(fingerprint_doc: Mapping[str, Any]) -> bool:
    inputs = fingerprint_doc.get("inputs") or []
    return bool(inputs) and not any("content_digest" in i for i in inputs)


def _without_content(fingerprint_doc: Mapping[str, Any]) -> dict[str, Any]:
    inputs = [{k: v for k, v in i.items() if k != "content_digest"} for i in fingerprint_doc["inputs"]]
    return {**fingerprint_doc, "inputs": inputs}


def _unweighed(fingerprint_doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fingerprint_doc.items() if k != "model_weights"}


def _name_changed_files(
    existing: Mapping[str, Any], model: ModelIdentity | None, differences: list[str]
) -> list[str]:
    """The model_weights line replaced by the files that changed, where both sides list them."""
    recorded = existing.get("model")
    if model is None or not isinstance(recorded, Mapping):
        return differences
    old = ModelIdentity.from_dict(recorded)
    if old.kind != model.kind:
        return differences
    changed = changed_files(old.files, model.files)
    rest = [d for d in differences if not d.startswith("model_weights:")]
    return [f"{c} since the output was made (same path, other weights)" for c in changed] + rest


def _check_same_kind(where: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """An incremental job cannot add to a plain job's output, nor a plain job to an incremental one."""
    if bool(old.get("incremental")) == bool(new.get("incremental")):
        return
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
