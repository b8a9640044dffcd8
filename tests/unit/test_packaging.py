"""Building the package: no setuptools warnings (data folders are declared as data packages), and
the wheel carries the data a user's install needs (the tiny model, the example job)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.paths import REPO


@pytest.mark.slow
def test_the_wheel_builds_quietly_and_carries_the_data(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "out", ".*_cache")
    shutil.copytree(REPO, source, ignore=skip)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-3000:]
    assert "is absent from the `packages` configuration" not in logs, logs[-3000:]
    assert "Warning" not in logs, logs[-3000:]
    (wheel,) = tmp_path.glob("ditfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "ditfleet/model/tiny/weights/transformer/diffusion_pytorch_model.safetensors",
        "ditfleet/model/tiny/weights/tokenizer/vocab.json",
        "ditfleet/jobs/examples/prompts.parquet",
        "ditfleet/jobs/examples/tiny.yaml",
        "ditfleet/model/qwen_image/published/qwen-image/transformer/config.json",
    ):
        assert data in names, data
