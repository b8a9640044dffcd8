"""docs/cluster.md's local `ray job submit` walkthrough, run as written: a head on 127.0.0.1 with
token authentication, the example job submitted, watched, verified, and only that head stopped.

The commands are read from the doc. Only what must differ on a shared test machine is changed:
the ports (free ones, also for the agents Ray would start on fixed defaults), HOME (a temporary one, so the token is the test's own) and the folder
it runs in (a temporary one holding the example job)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

DOC = REPO / "docs" / "cluster.md"


def walkthrough() -> str:
    (script,) = re.findall(r"```bash\n# local ray job submit walkthrough\n(.*?)```", DOC.read_text(), re.S)
    return script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_local_submit_walkthrough_runs_as_written(tmp_path):
    script = walkthrough()
    assert "--port=6390" in script and "127.0.0.1:8266" in script and "--dashboard-port=8266" in script
    # The walkthrough's own ports, and the agents' ports Ray picks by itself, free ones here: a
    # shared test machine runs other heads (a head whose agent cannot bind has no job server).
    free = {port: str(_free_port()) for port in ("6390", "8266", "52366", "6391")}
    assert all(re.search(rf"[=:]{port}\b", script) for port in free)
    script = re.sub(r"(?<=[=:])(6390|8266|52366|6391)\b", lambda m: free[m.group(1)], script)
    agent_ports = " ".join(
        f"--{flag}={_free_port()}"
        for flag in ("dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
    )
    assert script.count("--disable-usage-stats") == 1
    script = script.replace("--disable-usage-stats", f"--disable-usage-stats {agent_ports}")
    work, home = tmp_path / "work", tmp_path / "home"
    shutil.copytree(REPO / "jobs" / "examples", work / "jobs" / "examples")
    # The submission is what this test proves, not the images (the README job's own tests check
    # those): 2 steps an image instead of 20 and one actor instead of two, so the job itself is a
    # small part of the walkthrough.
    example = work / "jobs" / "examples" / "tiny.yaml"
    assert "steps: 20" in example.read_text() and "  max: 2" in example.read_text()
    example.write_text(example.read_text().replace("steps: 20", "steps: 2").replace("  max: 2", "  max: 1"))
    home.mkdir()
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=str(home), PATH=f"{bin_dir}:{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", TMPDIR="/tmp"
    )
    # A test head has nothing to drain: its GCS ends at once on the walkthrough's SIGTERM (by
    # default it waits 30 s, and _stop_head with it).
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        _stop_head(work / "out" / "ray-head.pid")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-4000:]
    assert "job succeeded" in out, out[-4000:]
    assert "Traceback" not in out, out[
        -4000:
    ]  # a try before the job server is up is one line  # the job's summary, watched through `ray job logs`
    assert "Job 'tiny-local' succeeded" in out, out[-2000:]  # `ray job status`
    assert re.search(r"verify \S+/out/tiny-submitted: OK", out), out[-2000:]
    assert (home / ".ray" / "auth_token").exists(), "the head ran with the walkthrough's token"
    assert len(list((work / "out" / "tiny-submitted" / "manifests").glob("*.parquet"))) == 6


def _stop_head(pid_file: Path) -> None:
    """The walkthrough stops its head; if it did not get there, stop that process group here."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(60):
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            import time

            time.sleep(1)
