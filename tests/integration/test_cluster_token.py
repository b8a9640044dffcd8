"""A cluster that wants Ray's token: `ditfleet run` and `ditfleet submit` without it (or with a
wrong one) exit 2 at once with one line naming RAY_AUTH_MODE=token and the token's path, and
write nothing (a real `ray start --head` with token authentication on)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.fixtures_ray import start_ray_head
from tests.support.paths import REPO
from tests.support.worker_fixtures import write_prompts


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A `ray start --head` that runs with RAY_AUTH_MODE=token and a token of its own (as every
    test head does), shared by this file's tests: each refused client leaves it as it was."""
    with start_ray_head(tmp_path_factory) as head:
        yield head


def _client_env(head, home: Path, **extra: str) -> dict[str, str]:
    """A new user's shell: no token settings, a home without ~/.ray/auth_token."""
    env = {k: v for k, v in head.env.items() if not k.startswith("RAY_AUTH")}
    return {**env, "HOME": str(home), **extra}


def _cli(args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ditfleet.jobs.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stderr, time.monotonic() - started


def _job(tmp_path: Path) -> tuple[Path, Path]:
    prompts = write_prompts(tmp_path / "prompts.parquet", 4)
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: tok\ninput: {{path: {prompts}}}\noutput: {{uri: {out}}}\n"
        "workers: {min: 1, gpus: 0, cpus: 1}\n"
    )
    return job, out


@pytest.mark.slow
def test_run_and_submit_without_the_token_exit_2_with_one_line_and_write_nothing(token_head, tmp_path):
    job, out = _job(tmp_path)
    home = tmp_path / "home"
    home.mkdir()

    env = _client_env(token_head, home, RAY_ADDRESS=token_head.gcs_address)
    code, err, took = _cli(["run", str(job)], env)
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert "RAY_AUTH_MODE=token" in lines[0] and str(home / ".ray" / "auth_token") in lines[0], lines[0]
    assert "retries" not in lines[0] and took < 30, (took, lines[0])  # no 20 s of GCS retries
    assert not out.exists(), "nothing written"

    env = _client_env(token_head, home)
    code, err, _ = _cli(["submit", str(job), "--address", token_head.dashboard_url, "--slot", "s1"], env)
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and "RAY_AUTH_MODE=token" in lines[0], err[-3000:]
    assert str(home / ".ray" / "auth_token") in lines[0] and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_a_wrong_token_is_named_with_its_file(token_head, tmp_path):
    job, out = _job(tmp_path)
    wrong = tmp_path / "wrong_token"
    wrong.write_text("not-the-clusters-token\n")
    env = _client_env(
        token_head,
        tmp_path,
        RAY_ADDRESS=token_head.gcs_address,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(wrong),
    )
    code, err, _ = _cli(["run", str(job)], env)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert f"refused the authentication token in {wrong}" in lines[0], lines[0]
    assert not out.exists()
