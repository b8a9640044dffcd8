"""Run a job from Python: what `ditfleet run` does, for users who drive ditfleet from code.

    import ditfleet
    summary = ditfleet.run("job.yaml")            # local Ray on 127.0.0.1, or RAY_ADDRESS
    summary = ditfleet.run(spec, address="auto")   # a JobSpec built in code

The job's memory plan is checked before any actor is asked for; a local Ray started here is shut
down when the job ends (a cluster this process was already connected to is left as it was).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.locations import check_local_output_nodes
from ditfleet.driver.memory_plan import JobMemoryPlan, job_memory_plan
from ditfleet.driver.output.summary import JobSummary
from ditfleet.driver.plan import JobPlan
from ditfleet.driver.run_job import check_job_input, run_job
from ditfleet.jobs.prompt_words import tiny_words_warning
from ditfleet.jobs.ray_auth import (
    CONNECT_DEADLINE_S,
    NoRayCluster,
    check_gcs_token,
    refused,
    wait_for_cluster,
)
from ditfleet.jobs.spec import JobSpec, SpecError, load_spec
from ditfleet.model.family import Size
from ditfleet.workers.output.manifest import committed_shards
from ditfleet.workers.storage import StoreError, open_store
from ditfleet.workers.storage.input_files import is_s3


def say(message: str) -> None:
    print(f"ditfleet: {message}", file=sys.stderr)


def connect_ray(address: str | None, deadline_s: float = CONNECT_DEADLINE_S) -> bool:
    """Connect to the cluster at `address` (or RAY_ADDRESS), or start a local one on loopback
    (every server it starts listens on 127.0.0.1 only). NoRayCluster when nothing answers there
    within `deadline_s` seconds.
    Returns False when this process was connected already (then the caller must not shut down)."""
    import ray

    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        wait_for_cluster(target, deadline_s)
        check_gcs_token(target)
        try:
            ray.init(address=address, logging_level=logging.WARNING)  # None: Ray reads RAY_ADDRESS
        except Exception as e:
            if any(words in str(e).lower() for words in _TOKEN_REFUSALS):
                raise refused(target) from e
            if isinstance(e, ConnectionError):  # the port answered, but not as a Ray head
                raise NoRayCluster(f"no Ray cluster at {target}: {e}") from e
            raise
        return True
    quiet_local_ray()
    with loopback_only():
        ray.init(
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.WARNING,
        )
    return True


def quiet_local_ray() -> None:
    """Keep a local run's log to what it says about the job.

    Ray turns token authentication on for a new local cluster when RAY_AUTH_MODE is unset, and
    warns on every run that it did; asking for it by name makes the same cluster (the token in
    ~/.ray/auth_token, created if missing) without the warning. Ray colours the prefix of every
    line it forwards from an actor: ANSI codes, also into a log file; off unless stderr is a
    terminal (RAY_COLOR_PREFIX set by the user wins)."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    if "RAY_AUTH_MODE" not in os.environ:
        _enable_token_auth()  # what Ray does by default, less its warning
    if "RAY_COLOR_PREFIX" not in os.environ and not sys.stderr.isatty():
        os.environ["RAY_COLOR_PREFIX"] = "0"


_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Keep the local cluster that ray.init starts on 127.0.0.1.

    On Linux Ray replaces a node address of 127.0.0.1 by the host's routable address, and its
    servers (GCS, raylet, dashboard, dashboard and runtime-env agents, workers) then listen on
    every interface, also with _node_ip_address="127.0.0.1". Ray's own switch for a single node
    on loopback is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which each process reads once, when it
    imports ray: the processes ray.init starts read it from the environment they inherit, but
    this one imported ray already, so its copy of the switch
    (ray._private.ray_constants.ENABLE_RAY_CLUSTER, which resolves the node address) is set
    too. Both are put back afterwards: the node's address is fixed once ray.init returns.
    tests/integration/test_local_ray_loopback.py reads the sockets every process listens on.
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved_env


# What Ray says when token authentication refuses a client (ray._private.authentication).
_TOKEN_REFUSALS = ("authentication token", "unauthenticated", "unauthorized")


def alive_ray_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def checked_spec(job: str | os.PathLike[str] | JobSpec) -> JobSpec:
    """The job's spec with its input's files and schemas checked (a missing prompt column, a file
    that is not Parquet: InputError naming file and column), before anything else reads the
    input: every command that takes a job file starts here, so each says the same thing."""
    spec = job if isinstance(job, JobSpec) else load_spec(job)
    try:
        check_job_input(spec.to_driver_config())
    except InputError as e:
        raise _relative_path_said(e, spec) from None
    return spec


def _relative_path_said(error: InputError, spec: JobSpec) -> InputError:
    """A problem with a relative input path itself (not found, no Parquet in it) says where such
    a path starts: users expect the job file's folder."""
    path = spec.input.path
    if is_s3(path) or os.path.isabs(path):
        return error
    note = (
        f"input.path {path!r} is relative, and relative paths start at the current directory "
        f"({os.getcwd()}), not at the job file's folder"
    )
    errors = [
        dataclasses.replace(e, hint=f"{e.hint}; {note}")
        if e.file == spec.input_uri() and e.row is None
        else e
        for e in error.errors
    ]
    return InputError(errors, error.total)


def interrupted_note(job: str) -> str:
    """What ctrl-C leaves of `job`'s output, said only about shards that exist."""
    try:
        spec = load_spec(job)
        store = open_store(spec.output_uri(), spec.s3_config())
        done = len(committed_shards(store))
    except (SpecError, StoreError, OSError, ValueError):
        return "interrupted"
    if not done:
        return f"interrupted before any shard was committed to {spec.output_uri()}; run the same command again to start"
    return (
        f"interrupted; the {done} shard{'s' if done != 1 else ''} committed to {spec.output_uri()} "
        "are kept: run the same command again to resume"
    )


def memory_plan_of(
    spec: JobSpec, bucket_sources: Mapping[str, tuple[Size, ...]] | None = None
) -> JobMemoryPlan | None:
    """The job's memory plan; None when the model cannot be read at plan time (hf://). An edit
    job's plan counts `bucket_sources` (its input plan's heaviest row per bucket).

    Without workers.gpu_memory_gb the plan is information only: a model whose configs cannot be
    read here (a bucket this machine has no access to) is reported, not an error."""
    try:
        return job_memory_plan(spec.memory_request(bucket_sources))
    except (StoreError, OSError, ValueError) as e:
        if spec.workers.gpu_memory_gb is not None:
            raise
        say(f"memory plan skipped: {spec.model.path}: {e}")
        return None


def check_memory(
    spec: JobSpec, job: str, bucket_sources: Mapping[str, tuple[Size, ...]] | None = None
) -> JobMemoryPlan | None:
    """Refuse a job whose batch cannot fit workers.gpu_memory_gb (nothing to check without it);
    an edit job's with `bucket_sources` (its plan's) counts them."""
    if spec.workers.gpu_memory_gb is None:
        return None
    memory = memory_plan_of(spec, bucket_sources)
    if memory is None:
        say(f"{job}: {spec.model.path}: configs are not read at plan time; memory not checked")
        return None
    memory.check(job)
    return memory


def run(
    job: str | os.PathLike[str] | JobSpec,
    address: str | None = None,
    redo_shards: Sequence[int] = (),
    connect_deadline_s: float = CONNECT_DEADLINE_S,
    verbose: bool = False,
) -> JobSummary:
    """Run or resume `job` (a job file or a JobSpec) and return its summary (`exit_code` says how
    it ended). `address`: a Ray cluster (else RAY_ADDRESS, else a local one on loopback); nothing
    answering there for `connect_deadline_s` seconds raises NoRayCluster (a ValueError), before
    anything is written. redo_shards: committed shards to run again under new attempts
    (docs/reliability.md, Redo). verbose: the summary also prints the model's internals."""
    spec = checked_spec(job)
    name = str(job) if not isinstance(job, JobSpec) else (spec.name or "the job")
    check_memory(spec, name)  # an edit job's as its text job: no source has been read yet

    def check_plan(plan: JobPlan) -> None:  # an edit job's again, with its rows' sources
        if plan.sources_per_bucket:
            check_memory(spec, name, plan.sources_per_bucket)

    driver, worker = spec.to_driver_config(), spec.to_worker_config()
    if (words := tiny_words_warning(spec)) is not None:
        say(f"warning: {words}")
    for note in spec.sampling_defaults.notes:  # e.g. a scheduler this machine could not read
        say(f"note: {note}")
    if redo_shards or verbose:
        driver = dataclasses.replace(driver, redo_shards=tuple(redo_shards), verbose=verbose)
    started = False

    def connect() -> None:
        nonlocal started
        started = connect_ray(address, connect_deadline_s) or started

    from ditfleet.driver.metrics import DriverMetrics

    try:
        cluster = address or os.environ.get("RAY_ADDRESS")
        if cluster:  # a cluster that is not there, or wants a token, refuses the job before any write
            wait_for_cluster(cluster, connect_deadline_s)
            check_gcs_token(cluster)
        if cluster and not is_s3(driver.output_uri) and not spec.output.shared_filesystem:
            connect()  # before anything is written: a local output needs a one-node cluster
            check_local_output_nodes(driver.output_uri, False, alive_ray_nodes())
        return run_job(
            driver, worker, connect=connect, events=DriverMetrics(job=spec.name or ""), check_plan=check_plan
        )
    finally:
        if started:
            import ray

            ray.shutdown()
