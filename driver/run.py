"""The driver's entry: plan, claim or resume the output, dispatch, and write `_SUCCESS`.

    summary = run_job(driver_config, worker_config)

1. Plan: validate every input row and cut shards (driver.plan). Bad input raises InputError
   here, before the output is touched or any actor starts.
2. Output: write `_job.json` create-only, or, if the output has one, check that its fingerprint
   is this plan's (else OutputMismatch, saying what differs). Committed shards (manifests) are
   skipped: running the same command again resumes.
3. Dispatch the remaining shards over worker actors (driver.dispatch).
4. Count rows and images from the manifests; when every shard is committed, write `_SUCCESS`
   (the summary, JSON). Print the summary. The caller exits with `summary.exit_code`.

Ray must be initialised by the caller (jobs/ does it), unless nothing is left to run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from driver.dispatch import DispatchConfig, DispatchResult, run_shards
from driver.plan import JobPlan, PlanConfig, fingerprint_mismatch, job_document, plan_job
from driver.progress import JobProgress
from driver.prompts import PromptSource
from driver.status import count_shards, read_json
from driver.summary import JobSummary, build_summary
from driver.validate import ValidationReport, validate_input
from workers.input_files import filesystem_for
from workers.layout import job_key, success_key
from workers.manifest import committed_shards
from workers.stores import ObjectStore, S3Config, open_store


class OutputMismatch(ValueError):
    """The output holds another job's results (different fingerprint) or is not a job output."""


@dataclass(frozen=True)
class DriverConfig:
    """What the driver needs; built by jobs/ from the job spec.

    resolved_spec: the job spec with every default filled in, as JSON text; stored in
    `_job.json` so that an output says how it was made.
    """

    input_uri: str
    output_uri: str
    plan: PlanConfig = field(default_factory=PlanConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    s3: S3Config = field(default_factory=S3Config)  # output store, and the input when on s3://
    resolved_spec: str = "{}"
    status_every_s: float = 30.0  # progress line interval when stderr is not a terminal

    def __post_init__(self) -> None:
        if not self.input_uri or not self.output_uri:
            raise ValueError("DriverConfig needs an input_uri and an output_uri")
        try:
            json.loads(self.resolved_spec)
        except ValueError as e:
            raise ValueError(f"DriverConfig.resolved_spec must be JSON text: {e}") from e


def prompt_source(config: DriverConfig) -> PromptSource:
    fs = filesystem_for(config.input_uri, endpoint_url=config.s3.endpoint_url, region=config.s3.region)
    return PromptSource(config.input_uri, fs)


def validate_job_input(config: DriverConfig) -> ValidationReport:
    """Every problem of the input (up to the plan's max_errors); reads the input, nothing else."""
    return validate_input(prompt_source(config), config.plan.rows, config.plan.max_errors)


def plan_input(config: DriverConfig) -> JobPlan:
    """Validate and plan; raises driver.errors.InputError (all problems, up to the cap)."""
    return plan_job(prompt_source(config), config.plan)


def claim_output(store: ObjectStore, plan: JobPlan, resolved_spec: dict[str, Any]) -> bool:
    """Make `store` this plan's output: write `_job.json` create-only, or check the one there.

    Returns True when the output already belonged to this plan (a resume). Raises OutputMismatch
    naming what differs when it belongs to another job.
    """
    where = store.uri()
    existing = read_json(store, job_key())
    if existing is None:
        if committed_shards(store):
            raise OutputMismatch(
                f"output {where} has shard manifests but no _job.json, so it cannot be checked against "
                "this job. Choose a new output, or restore its _job.json"
            )
        created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        doc = job_document(plan, resolved_spec, created_at=created)
        if store.put_if_absent(job_key(), (json.dumps(doc, indent=2) + "\n").encode(), "application/json"):
            return False
        existing = read_json(store, job_key())  # another driver claimed it just now
        assert existing is not None
    differences = fingerprint_mismatch(existing, plan)
    if differences:
        listed = "\n".join(f"  - {d}" for d in differences)
        raise OutputMismatch(
            f"output {where} belongs to another job (its _job.json fingerprint differs):\n{listed}\n"
            "Write to a new output, or run with the settings and input it was made with"
        )
    return True


def _done_summary(store: ObjectStore) -> JobSummary | None:
    doc = read_json(store, success_key())
    if doc is None:
        return None
    names = {f.name for f in dataclasses.fields(JobSummary)}
    try:
        return JobSummary(**{k: v for k, v in doc.items() if k in names})
    except TypeError:
        return None  # written by another version: recount


def run_job(
    config: DriverConfig,
    worker_config: Any,
    *,
    worker_cls: type | None = None,
    stream: TextIO | None = None,
    interactive: bool | None = None,
    connect: Callable[[], Any] | None = None,
) -> JobSummary:
    """Run (or resume) a job to the end and return its summary; see the module docstring.

    worker_config: workers.actor.WorkerConfig, handed to each actor (its warmup_buckets are set
    to the buckets of the shards left, when empty). worker_cls: the actor class, by default
    workers.actor.GenerationWorker (tests pass a stand-in with the same methods). connect: called
    once planning passed and there are shards to run, to connect to Ray (so a bad input or an
    already complete output never waits for a cluster).
    Raises InputError (bad input), OutputMismatch (output of another job), DispatchError.
    """
    out = stream if stream is not None else sys.stderr
    t0 = time.monotonic()
    plan = plan_input(config)
    plan_s = time.monotonic() - t0
    if getattr(worker_config, "output_uri", config.output_uri) != config.output_uri:
        raise ValueError(
            f"the worker writes to {worker_config.output_uri!r} but the driver's output is "
            f"{config.output_uri!r}: build both configs from the same spec"
        )
    store = open_store(config.output_uri, config.s3)
    store.check_writable()
    claim_output(store, plan, json.loads(config.resolved_spec))
    planned = {"shards": len(plan.shards), "rows": plan.total_rows, "images": plan.total_images}
    done = committed_shards(store) & {s.index for s in plan.shards}
    todo = [s for s in plan.shards if s.index not in done]
    if not todo and (previous := _done_summary(store)) is not None:
        print(f"{store.uri()}: already complete ({len(done)} shards committed); nothing to do", file=out)
        return previous
    if done:
        print(f"resuming {store.uri()}: {len(done)} of {len(plan.shards)} shards already committed", file=out)
    progress = JobProgress(
        total_shards=len(plan.shards),
        total_images=plan.total_images,
        done_shards=len(done),
        done_images=sum(s.num_images for s in plan.shards if s.index in done),
        stream=out,
        interactive=interactive,
        status_every_s=config.status_every_s,
    )
    t1 = time.monotonic()
    result: DispatchResult | None = None
    if todo:
        if hasattr(worker_config, "warmup_buckets") and not worker_config.warmup_buckets:
            used = {b for s in todo for b in s.buckets_used}
            buckets = tuple(b for b in plan.buckets_used if b in used)
            worker_config = dataclasses.replace(worker_config, warmup_buckets=buckets)
        if worker_cls is None:
            from workers.actor import GenerationWorker

            worker_cls = GenerationWorker
        if connect is not None:
            connect()
        try:
            result = run_shards(todo, worker_cls, (worker_config,), config.dispatch, progress)
        finally:
            progress.close()
    dispatch_s = time.monotonic() - t1
    t2 = time.monotonic()
    committed = committed_shards(store) & {s.index for s in plan.shards}
    counts = count_shards(store, sorted(committed))
    summary = build_summary(
        output=store.uri(),
        fingerprint=plan.fingerprint(),
        planned=planned,
        committed_before=len(done),
        counts=counts,
        dispatch=result,
        progress=progress,
        timings={
            "plan_s": plan_s,
            "dispatch_s": dispatch_s,
            "count_s": time.monotonic() - t2,
            "wall_s": time.monotonic() - t0,
        },
    )
    if summary.shards["left"] == 0:
        store.put(success_key(), summary.to_json().encode(), "application/json")
    print(summary.format_text(), file=out)
    return summary


__all__ = [
    "DispatchConfig",
    "DriverConfig",
    "OutputMismatch",
    "PlanConfig",
    "claim_output",
    "plan_input",
    "run_job",
    "validate_job_input",
]
