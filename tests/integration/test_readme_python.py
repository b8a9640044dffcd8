"""README's "Using it from Python" job block runs as written: the example job, then a changed
copy of its spec, on a local Ray the block's own process starts (a fresh process, as a user's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pyarrow.dataset as ds
import pytest

from tests.support.fixtures_ray import LOOPBACK_ENV
from tests.support.paths import REPO
from tests.support.readme_blocks import readme_blocks

pytestmark = pytest.mark.slow


def test_the_readme_python_job_block_runs_as_written(tmp_path):
    block = readme_blocks("Using it from Python")[0]
    assert 'ditfleet.run("jobs/examples/tiny.yaml")' in block
    # The block's relative paths start at the repository root; a copy of what they name keeps
    # the test's outputs out of the checkout.
    examples = tmp_path / "jobs" / "examples"
    examples.mkdir(parents=True)
    for name in ("tiny.yaml", "prompts.parquet"):
        shutil.copy(REPO / "jobs" / "examples" / name, examples / name)
    # A user's shell: no cluster named, and no thread count (the suite's OMP_NUM_THREADS would
    # reach the actors, where Ray otherwise sets one thread per CPU asked for, and two actors on
    # two busy cores with two threads each wait on each other for minutes).
    dropped = ("RAY_ADDRESS", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in dropped} | LOOPBACK_ENV
    log = tmp_path / "log.txt"
    with log.open("w") as sink:
        done = subprocess.run(
            [sys.executable, "-c", block],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, log.read_text()[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0 48"  # what the block's comment says it prints
    for out, steps in (("tiny", 20), ("ten-steps", 10)):
        table = ds.dataset(tmp_path / "out" / out / "manifests", format="parquet").to_table()
        assert table.num_rows == 48 and set(table.column("status").to_pylist()) == {"ok"}
        assert set(table.column("steps").to_pylist()) == {steps}
