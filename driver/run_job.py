"""The driver's entry: plan, claim or resume the output, dispatch, and write `_SUCCESS`.

    summary = run_job(driver_config, worker_config)

1. Plan: validate every input row and cut shards (driver.plan). Bad input raises InputError
   here, before the output is touched or any actor starts.
2. Output: write `_job.json` create-only, or, if the output has one, check that its fingerprint
   is this plan's (else OutputMismatch, saying what differs; driver.output.claim). Committed shards
   (manifests) are skipped: running the same command again resumes.
3. Dispatch the remaining shards over worker actors (driver.dispatch).
4. Finish (driver.output.finish): count rows and images from the manifests, delete the orphans of this
   run's shards, and when every shard is committed write `_SUCCESS` (the summary, JSON). Print
   the summary. The caller exits with `summary.exit_code`.

An incremental job (DriverConfig.incremental, see driver.increment) runs steps 1-2 differently:
`_job.json` fingerprints the settings alone; each run plans only the rows its output does not
have yet, records its shards in `_runs/` (driver.run_records), and runs them together with any
shard an earlier run left uncommitted. Its summary counts this run's shards; `ditfleet status`
counts the output. Steps 3-4 are the same code for both.

Ray must be initialised by the caller (jobs/ does it), unless nothing is left to run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ditfleet.driver.dispatch import DispatchConfig, DispatchEvents, DispatchResult, run_shards
from ditfleet.driver.increment import IncrementPlan, commit_increment, plan_increment
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.scan import check_schemas, validate_input
from ditfleet.driver.input.validate import ValidationReport
from ditfleet.driver.locations import check_locations
from ditfleet.driver.metrics import FanOut
from ditfleet.driver.output.case_fold import refuse_ids_that_fold
from ditfleet.driver.output.claim import OutputMismatch, claim_incremental_output, claim_output
from ditfleet.driver.output.cost import CostConfig
from ditfleet.driver.output.fence import wait_actors_gone
from ditfleet.driver.output.finish import close_output, finish_run
from ditfleet.driver.output.lease import OutputLease, acquire_lease
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.driver.output.settle import Settled, settle_older
from ditfleet.driver.output.status import OutputCounts
from ditfleet.driver.output.success import remove_success
from ditfleet.driver.output.summary import FAILED, JobSummary, RunOutcome, build_summary, read_success
from ditfleet.driver.plan import JobPlan, PlanConfig, idle_actors_warning, plan_job
from ditfleet.driver.plan_file import load_plan, save_plan
from ditfleet.driver.progress import JobProgress
from ditfleet.driver.rerun import complete_already, redo_generations
from ditfleet.workers.contract import WorkerConfig
from ditfleet.workers.output.manifest import committed_shards
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore, S3Config, open_store
from ditfleet.workers.storage.input_files import filesystem_for, is_s3
from ditfleet.workers.weights.digest import ModelIdentity, model_identity

_PLAN_TRIES = 5  # an incremental run plans again when another driver took its run number


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
    # The input grows between runs: each run adds only the rows the output lacks (driver.increment).
    incremental: bool = False
    # A local output on a filesystem every node mounts at the same path (else only actors on the
    # driver's node may write it).
    shared_filesystem: bool = False
    # Committed shards to run again under new attempts, each committing its next manifest
    # generation (workers.output.layout.manifest_key); the other shards are left as they are.
    redo_shards: tuple[int, ...] = ()
    cost: CostConfig = field(default_factory=CostConfig)  # the price the summary and report use
    # The summary prints the model's internals too (the DiT attention counters); _SUCCESS keeps them.
    verbose: bool = False

    def __post_init__(self) -> None:
        if not self.input_uri or not self.output_uri:
            raise ValueError("DriverConfig needs an input_uri and an output_uri")
        if self.redo_shards and self.incremental:
            raise ValueError(
                "redo_shards is for a plain job's output; an incremental job's shards are redone by "
                "running its job to a new output"
            )
        try:
            json.loads(self.resolved_spec)
        except ValueError as e:
            raise ValueError(f"DriverConfig.resolved_spec must be JSON text: {e}") from e


def prompt_source(config: DriverConfig) -> PromptSource:
    # Every path that reads the input (validate, plan, run) first checks where input and output are.
    check_locations(config.input_uri, config.output_uri)
    fs = filesystem_for(config.input_uri, endpoint_url=config.s3.endpoint_url, region=config.s3.region)
    return PromptSource(config.input_uri, fs)


def validate_job_input(config: DriverConfig) -> ValidationReport:
    """Every problem of the input (up to the plan's max_errors); reads the input, nothing else."""
    return validate_input(prompt_source(config), config.plan.rows, config.plan.max_errors)


def check_job_input(config: DriverConfig) -> None:
    """Where input and output are, and the input's files and schemas (no row read): raises
    LocationError or InputError. Every command that takes a job file calls it first."""
    check_schemas(prompt_source(config), config.plan.rows, config.plan.max_errors)


def plan_input(config: DriverConfig) -> JobPlan:
    """Validate and plan; raises driver.input.row_errors.InputError (all problems, up to the cap)."""
    return plan_job(prompt_source(config), config.plan, s3=config.s3)


@dataclass(frozen=True)
class _Work:
    """What a run dispatches, and what its summary counts."""

    store: ObjectStore
    fingerprint: str
    shards: Sequence[ShardSpec]  # counted: a plain job's plan, or one incremental run's shards
    committed_before: frozenset[int]  # of `shards`, committed before this run
    planned: dict[str, int]  # shards, rows, images of `shards`
    buckets_order: Sequence[str]  # the order actors warm buckets up in
    plan_s: float

    @property
    def todo(self) -> list[ShardSpec]:
        return [s for s in self.shards if s.index not in self.committed_before]


def run_job(
    config: DriverConfig,
    worker_config: WorkerConfig,
    *,
    worker_cls: type | None = None,
    stream: TextIO | None = None,
    interactive: bool | None = None,
    connect: Callable[[], object] | None = None,
    events: DispatchEvents | None = None,
) -> JobSummary:
    """Run (or resume) a job to the end and return its summary; see the module docstring.

    worker_config: handed to each actor (its warmup_buckets are set to the buckets of the
    shards left, when empty). worker_cls: the actor class, by default
    workers.actor.GenerationWorker (tests pass a stand-in with the same methods). connect: called
    once planning passed and there are shards to run, to connect to Ray (so a bad input or an
    already complete output never waits for a cluster). events: a second sink for dispatch
    events next to the progress display (the CLI passes the driver's metrics, exported to Ray);
    its finish() runs once dispatch is over.
    Raises InputError (bad input), OutputMismatch (output of another job), DispatchError.
    """
    out = stream if stream is not None else sys.stderr
    if worker_config.output_uri != config.output_uri:
        raise ValueError(
            f"the worker writes to {worker_config.output_uri!r} but the driver's output is "
            f"{config.output_uri!r}: build both configs from the same spec"
        )
    run = _Execution(config, worker_config, worker_cls, out, interactive, connect, events)
    try:
        return _run(run)
    finally:
        if run.lease is not None:
            run.lease.release()


def _run(run: _Execution) -> JobSummary:
    config, out = run.config, run.out
    started = time.monotonic()
    work = _incremental_work(run, started) if config.incremental else _plain_work(run, started)
    if isinstance(work, JobSummary):
        return work  # nothing to run
    progress = run.progress(
        len(work.shards),
        work.planned["images"],
        len(work.committed_before),
        sum(s.num_images for s in work.shards if s.index in work.committed_before),
    )
    t1 = time.monotonic()
    run.record(work.todo)
    result = run.dispatch(work.todo, work.buckets_order, progress)
    timings = {"plan_s": work.plan_s, "dispatch_s": time.monotonic() - t1}
    return finish_run(
        work.store,
        RunOutcome(
            work.shards,
            work.committed_before,
            work.fingerprint,
            work.planned,
            result,
            progress,
            timings,
            gpus_per_actor=config.dispatch.num_gpus,
            cost=config.cost,
        ),
        started=started,
        out=out,
        lease=run.lease,
        settled=run.settled,
        verbose=config.verbose,
    )


def _plain_work(run: _Execution, started: float) -> _Work | JobSummary:
    """Plan, claim the output, and leave out the committed shards; the summary in `_SUCCESS`
    when the output is complete already."""
    config, out = run.config, run.out
    store = open_store(config.output_uri, config.s3)
    # A rerun of the same input and settings reads the plan it stored (driver.plan_file)
    # instead of scanning every row again.
    stored = load_plan(store, prompt_source(config), config.plan)
    plan = stored if stored is not None else plan_input(config)
    plan_s = time.monotonic() - started
    for warning in plan.warnings:
        print(f"warning: {warning}", file=out)
    store.check_writable()
    run.hold(store)
    run.refuse_ids_that_fold(store)
    claim_output(store, plan, json.loads(config.resolved_spec), run.model, prompt_source(config))
    done = committed_shards(store) & {s.index for s in plan.shards}
    redo = redo_generations(store, plan.shards, done, config.redo_shards)  # refused: nothing written
    if stored is None:
        save_plan(store, plan)
    holder = run.lease.generation if run.lease is not None else None
    if (
        len(done) == len(plan.shards)
        and not redo
        and (previous := read_success(store, holder, out)) is not None
    ):
        summary = complete_already(store, previous, len(done), out)
        if summary.status != FAILED:  # still complete: `_SUCCESS` is this driver's now
            close_output(
                store, lease=run.lease, settled=run.settled, own=(), redo={}, success=previous, out=out
            )
        return summary
    _prepare_to_write(store, run.lease, out)
    idle = idle_actors_warning(
        len(plan.shards), plan.total_rows, config.plan.shard_size, config.dispatch.max_actors
    )
    if idle is not None:
        print(f"warning: {idle}", file=out)
    shards: Sequence[ShardSpec] = plan.shards
    if redo:
        shards = tuple(
            dataclasses.replace(s, generation=redo[s.index]) if s.index in redo else s for s in shards
        )
        done -= set(redo)
        print(
            f"redoing shards {sorted(redo)} of {store.uri()} under new attempts; their committed "
            "manifests stay as written, each redo commits the next generation, which supersedes them",
            file=out,
        )
    if done:
        print(f"resuming {store.uri()}: {len(done)} of {len(plan.shards)} shards already committed", file=out)
    return _Work(
        store,
        plan.fingerprint(),
        shards,
        frozenset(done),
        {"shards": len(plan.shards), "rows": plan.total_rows, "images": plan.total_images},
        plan.buckets_used,
        plan_s,
    )


def _incremental_work(run: _Execution, started: float) -> _Work | JobSummary:
    """Plan the next run of an incremental job (writing its record); its summary when there is
    nothing new to run."""
    config, out = run.config, run.out
    store = open_store(config.output_uri, config.s3)

    def hold() -> None:  # before the run's first write
        run.hold(store)
        run.refuse_ids_that_fold(store)

    plan = _plan_increment(config, store, run.model, hold)
    plan_s = time.monotonic() - started
    for line in plan.describe():
        print(line, file=out)
    todo = plan.todo
    planned = {
        "shards": len(todo),
        "rows": sum(s.num_rows for s in todo),
        "images": sum(s.num_images for s in todo),
    }
    if not todo:
        shards = len(plan.recorded.live())
        print(
            f"{store.uri()}: nothing new in {plan.files} input file(s); all {shards} shards committed",
            file=out,
        )
        timings = {"plan_s": 0.0, "dispatch_s": 0.0, "count_s": 0.0, "wall_s": time.monotonic() - started}
        outcome = RunOutcome(todo, frozenset(), plan.fingerprint, planned, None, run.progress(0, 0), timings)
        summary = build_summary(store.uri(), outcome, OutputCounts())
        if shards and read_success(store, out=out) is None:
            # Every shard is committed but no run got to write _SUCCESS (it stopped just before,
            # or a later driver took the output since): this run writes it, under the lease.
            run.hold(store)
            close_output(
                store, lease=run.lease, settled=run.settled, own=(), redo={}, success=summary, out=out
            )
        return summary  # nothing new and a valid _SUCCESS: nothing is written, no lease taken
    run.hold(store)
    # commit_increment removed `_SUCCESS` before writing a new record; this catches shards
    # carried over from a run that left it behind.
    _prepare_to_write(store, run.lease, out)
    order = config.plan.rows.buckets.names
    return _Work(store, plan.fingerprint, todo, frozenset(), planned, order, plan_s)


@dataclass
class _Execution:
    """The parts of a run shared by plain and incremental jobs: progress and dispatch."""

    config: DriverConfig
    worker_config: WorkerConfig
    worker_cls: type | None
    out: TextIO
    interactive: bool | None
    connect: Callable[[], object] | None
    events: DispatchEvents | None

    lease: OutputLease | None = None
    settled: Settled = field(default_factory=Settled)

    @functools.cached_property
    def model(self) -> ModelIdentity | None:
        """The identity of the model's bytes (once per run), also handed to every actor, which
        refuses to start on other weights; None when this machine cannot read the model."""
        wc = self.worker_config
        try:
            identity = model_identity(wc.model_path, wc.model_cache_dir, wc.s3, wc.loras, wc.scheduler_config)
        except Exception as e:  # noqa: BLE001 - the actors' own fetch reports what is wrong
            print(
                f"warning: model {wc.model_path} cannot be read here ({type(e).__name__}: {e}); "
                "the output does not record its weights' digest and actors are not checked against it",
                file=self.out,
            )
            return None
        if identity is not None:
            self.worker_config = dataclasses.replace(wc, model_identity=identity.to_dict())
        return identity

    def hold(self, store: ObjectStore) -> OutputLease | None:
        """Own the output for this run (one driver at a time; raises OutputBusy), then settle
        what earlier drivers left open (driver.output.settle), before anything is planned.
        Returns the lease."""
        if self.lease is None:
            self.lease = acquire_lease(store)
            self.settled = settle_older(store, self.lease.generation)
        return self.lease

    def refuse_ids_that_fold(self, store: ObjectStore) -> None:
        """Before the output is claimed: on a store that folds case, refuse ids that differ only
        in case where they would name one object (InputError; driver.output.case_fold)."""
        refuse_ids_that_fold(
            store, prompt_source(self.config), self.config.plan.rows, self.worker_config.writer.output_format
        )

    def record(self, todo: Sequence[ShardSpec]) -> None:
        """Write into the lease document the shards this run dispatches and its redo
        generations, before it dispatches any (raises OutputBusy when the output was taken)."""
        if self.lease is not None and todo:
            self.lease.record_work(
                (s.index for s in todo), {s.index: s.generation for s in todo if s.generation}
            )

    def progress(self, shards: int, images: int, done_shards: int = 0, done_images: int = 0) -> JobProgress:
        return JobProgress(
            total_shards=shards,
            total_images=images,
            done_shards=done_shards,
            done_images=done_images,
            stream=self.out,
            interactive=self.interactive,
            status_every_s=self.config.status_every_s,
        )

    def dispatch(
        self, todo: Sequence[ShardSpec], buckets_order: Sequence[str], progress: JobProgress
    ) -> DispatchResult | None:
        """Run `todo` on worker actors (connecting to Ray first); None when there is nothing."""
        if not todo:
            progress.close()
            return None
        worker_config = _fill_in_for(self.worker_config, todo, buckets_order, self.config.dispatch.max_actors)
        worker_cls = self.worker_cls
        if worker_cls is None:
            from ditfleet.workers.actor import GenerationWorker

            worker_cls = GenerationWorker
        if self.connect is not None:
            self.connect()
        worker_config = _pin_output_node(self.config, worker_config)
        try:
            events = FanOut(progress, _PauseOnFirstStart(), self.events)
            # No per-shard result is kept to the end (400,000 of them): progress and metrics
            # take each as it comes, and the summary counts the manifests.
            result = run_shards(
                todo, worker_cls, (worker_config,), self.config.dispatch, events, keep_results=False
            )
            # Every actor is killed; wait until none can still write before anything is closed.
            result.unfenced_actors = wait_actors_gone(result.actors, self.config.dispatch.fence_timeout_s)
            return result
        finally:
            progress.close()
            if self.events is not None:
                self.events.finish()


class _PauseOnFirstStart(DispatchEvents):
    """The test seam `after_dispatch_start` (driver.output.pause_points): once the first shard
    is handed to an actor, the lease document saying what this run does being written."""

    def __init__(self) -> None:
        self._started = False

    def shard_started(self, shard: ShardSpec, attempt: int, worker_id: str, speculative: bool) -> None:
        if not self._started:
            self._started = True
            pause_point("after_dispatch_start")


def _fill_in_for(
    worker_config: WorkerConfig, todo: Sequence[ShardSpec], buckets_order: Sequence[str], max_actors: int
) -> WorkerConfig:
    """The worker settings left to the driver, from the shards to run: the buckets to warm up
    (those the shards use, in the bucket set's order) and the images one actor can expect to
    make (it decides whether compiling the DiT pays off)."""
    if not worker_config.warmup_buckets:
        used = {b for s in todo for b in s.buckets_used}
        buckets = tuple(b for b in buckets_order if b in used)
        worker_config = dataclasses.replace(worker_config, warmup_buckets=buckets)
    if worker_config.expected_images is None:
        images = sum(s.num_images for s in todo)
        worker_config = dataclasses.replace(worker_config, expected_images=-(-images // max(1, max_actors)))
    return worker_config


def _pin_output_node(config: DriverConfig, worker_config: WorkerConfig) -> WorkerConfig:
    """A node-local output: actors must run on the driver's node (the worker checks)."""
    if is_s3(config.output_uri) or config.shared_filesystem:
        return worker_config
    import ray

    if not ray.is_initialized():
        return worker_config
    node = ray.get_runtime_context().get_node_id()
    return dataclasses.replace(worker_config, local_output_node=node)


def preview_increment(config: DriverConfig) -> IncrementPlan:
    """What the next run of an incremental job would do, writing nothing (`ditfleet plan`).
    Raises InputError, OutputMismatch as a run would."""
    store = open_store(config.output_uri, config.s3)
    resolved = json.loads(config.resolved_spec)
    fingerprint = claim_incremental_output(store, config.plan, config.input_uri, resolved, write=False)
    return plan_increment(
        prompt_source(config), config.plan, store, committed_shards(store), fingerprint, s3=config.s3
    )


def _plan_increment(
    config: DriverConfig,
    store: ObjectStore,
    model: ModelIdentity | None,
    hold: Callable[[], OutputLease | None],
) -> IncrementPlan:
    """Plan the next run and write its record; plans again if another driver took the number.

    Nothing is written before the new files passed validation, and nothing at all when there
    is nothing new; `hold` (taking the lease, returned) is called before the first write.
    """
    source = prompt_source(config)
    spec = json.loads(config.resolved_spec)
    for _ in range(_PLAN_TRIES):
        # Refuses changed settings before reading any input; writes nothing.
        fingerprint = claim_incremental_output(
            store, config.plan, config.input_uri, spec, write=False, model=model
        )
        plan = plan_increment(source, config.plan, store, committed_shards(store), fingerprint, s3=config.s3)
        if plan.record is None:
            return plan
        store.check_writable()
        lease = hold()
        claim_incremental_output(store, config.plan, config.input_uri, spec, model=model)
        written = commit_increment(store, plan, lease)
        if written is not None:
            return written
    raise OutputMismatch(
        f"output {store.uri()}: another driver planned a run at the same time, {_PLAN_TRIES} times in "
        "a row. Is a second `ditfleet run` of this job writing to it? Let one run at a time"
    )


def _prepare_to_write(store: ObjectStore, lease: OutputLease | None, out: TextIO) -> None:
    """Before a run writes to an output that is not complete: `_SUCCESS` goes (fenced by the
    lease: driver.output.success), so that no reader takes the output for finished while it
    changes, and the temp files of writers killed mid-write (local outputs), which would stay
    forever, are removed."""
    remove_success(store, lease)
    removed = store.remove_stale_temp_files()
    if removed:
        print(f"{store.uri()}: removed {removed} temporary file(s) left by killed writers", file=out)


__all__ = [
    "DriverConfig",
    "OutputMismatch",
    "claim_output",
    "plan_input",
    "preview_increment",
    "run_job",
    "validate_job_input",
]
