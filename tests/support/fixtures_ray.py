"""Ray fixtures: one local cluster per test session, bound to 127.0.0.1.

`ray_cluster` starts Ray in-process once (`ray.init`) and shuts it down when the session ends.
Tests that need their own cluster (`ray start --head` for job submission) use `ray_head`, which
runs a separate head in its own temp dir and stops exactly the process it started.

On Linux, Ray replaces a node address of 127.0.0.1 by the host's routable address and its
servers then listen on every interface. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps the node on
loopback (single-node only, which is all a test needs), so nothing listens beyond 127.0.0.1. Ray
reads it once, at import: the in-process cluster starts under `ditfleet.jobs.run.loopback_only`,
which also sets this process's already imported copy; a `ray start` child gets it in its env.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fixtures_s3 import FAKE_CREDENTIALS

LOOPBACK = "127.0.0.1"
# See the module docstring: keeps every Ray server of a test cluster on loopback.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
SESSION_CPUS = 4  # logical CPUs: test actors mostly sleep or are small, 2 real cores run them


@dataclass(frozen=True)
class RayCluster:
    """The session's Ray: `address` is the GCS address a second driver could connect to."""

    address: str
    num_cpus: int


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A local Ray cluster for the whole test session (4 logical CPUs, no GPU, no dashboard)."""
    import ray

    from ditfleet.jobs.run import loopback_only

    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    if ray.is_initialized():  # a test that called ray.init itself must not leak into the others
        ray.shutdown()
    with loopback_only():
        _init_session_cluster(ray)
    try:
        yield RayCluster(address=ray.get_runtime_context().gcs_address, num_cpus=SESSION_CPUS)
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _init_session_cluster(ray) -> None:
    ray.init(
        # "local": always a fresh cluster of our own, never one a `ray start` left on this machine.
        address="local",
        num_cpus=SESSION_CPUS,
        num_gpus=0,
        include_dashboard=False,
        _node_ip_address=LOOPBACK,
        object_store_memory=256 * 1024 * 1024,
        logging_level="WARNING",
        log_to_driver=True,
        # Actors reach the moto server with its fake credentials, whichever fixture came first.
        runtime_env={"env_vars": dict(FAKE_CREDENTIALS)},
    )


@dataclass(frozen=True)
class RayHead:
    """A `ray start --head` cluster: `dashboard_url` is what `ray job submit --address` takes."""

    gcs_address: str
    dashboard_url: str
    env: dict[str, str]  # the environment to run `ray job submit` (or a driver) against it

    def job_submit(self, args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
        """`ray job submit --address <head> <args>` (waits for the job), retried while the
        head's job agent is still starting (it answers "No available agent" until then)."""
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run(
                [ray_bin, "job", "submit", "--address", self.dashboard_url, *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=max(deadline - time.monotonic(), 1),
            )
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline - 60:
                return done
            time.sleep(2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path_factory) -> Iterator[RayHead]:
    """A separate Ray head on 127.0.0.1 with its dashboard (the job server) on 127.0.0.1, for
    one test (`start_ray_head`)."""
    with start_ray_head(tmp_path_factory) as head:
        yield head


@contextlib.contextmanager
def start_ray_head(tmp_path_factory) -> Iterator[RayHead]:
    """Run `ray start --head --block` as a child process in its own temp dir and session, and
    kill that process group at the end (never `ray stop`, which would stop every cluster on the
    machine, the session's included).

    The head runs with token authentication and a token of its own (in its temp dir), named in
    `RayHead.env`: what a new head does anyway once ~/.ray/auth_token exists, and then the same
    whatever this machine's home holds or whether this process started a Ray before.
    """
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # Ray's unix socket paths must stay short (107 bytes): a short temp dir, not pytest's.
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    gcs_port, dashboard_port = _free_port(), _free_port()
    # Ports Ray would otherwise take at fixed defaults (52365, 10001, ...): the session's cluster
    # (or anyone else's) may hold those, and a head whose agent cannot bind has no job server.
    fixed = [
        f"--{flag}={_free_port()}"
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "ray-client-server-port",
        )
    ]
    # The job's entrypoint finds `ditfleet` on PATH (this venv) and the moto credentials.
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        **LOOPBACK_ENV,
        **FAKE_CREDENTIALS,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32) + "\n")
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    log = open(tmp_path_factory.mktemp("ray-head") / "ray-head.log", "wb")
    proc = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--node-ip-address={LOOPBACK}",
            f"--port={gcs_port}",
            "--include-dashboard=true",
            f"--dashboard-host={LOOPBACK}",
            f"--dashboard-port={dashboard_port}",
            "--num-cpus=2",
            "--num-gpus=0",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            *fixed,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    head = RayHead(
        gcs_address=f"{LOOPBACK}:{gcs_port}",
        dashboard_url=f"http://{LOOPBACK}:{dashboard_port}",
        env={**env, "RAY_ADDRESS": f"http://{LOOPBACK}:{dashboard_port}"},
    )
    try:
        _wait_for_job_server(head.dashboard_url, proc, timeout_s=120)
        yield head
    finally:
        _stop_group(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_job_server(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}; see the ray-head.log")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2) as reply:
                if reply.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code == 401:  # token authentication is on: the server answers, `ray job` sends the token
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Ray job server at {url} did not answer within {timeout_s:.0f} s")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL the head's process group (raylet, GCS, workers). A test cluster holds nothing worth
    a graceful stop, which costs 3 s (5 s with token authentication, whose head outlives SIGTERM);
    its temp dir is removed after."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def run_own_cluster(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """Run a child that starts its own Ray (and whatever else) in its own session, away from the
    session's cluster; return (returncode, stdout, stderr). If it runs over `timeout_s`, its whole
    process group is killed and the test fails with the end of its stderr."""
    env = {**env, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` ran over {timeout_s:.0f} s:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:  # interrupted: leave no cluster behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, out, err
