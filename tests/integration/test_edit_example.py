"""README's edit job runs as written: its five-line job file over jobs/examples/edits.parquet on
the bundled tiny edit model, with `ditfleet run` on a local Ray, as a user runs it. Every row is
made once, names its source by the struct's path and its bytes' sha256, keeps its source's size,
and the edited images follow their instructions (model.tiny.edit_adherence) as the model's own
held-out numbers say."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ditfleet.model.tiny.edit_adherence import edit_score
from ditfleet.model.tiny.edits import parse_instruction
from ditfleet.model.tiny.scenes import parse_caption
from tests.support.fixtures_ray import LOOPBACK_ENV
from tests.support.paths import REPO
from tests.support.readme_blocks import readme_blocks

pytestmark = pytest.mark.slow

# The share of the 24 edits that must pass: the shipped weights pass 9 of 24 (docs/tiny-model.md
# has the model's numbers: it shows most instructions but keeps the rest of the picture in few).
FLOOR = 0.3


def test_the_readme_edit_job_runs_as_written_and_its_images_follow_their_instructions(tmp_path):
    [job] = [b for b in readme_blocks("The main job and what it makes", "yaml") if "image_column" in b]
    examples = tmp_path / "jobs" / "examples"
    examples.mkdir(parents=True)
    shutil.copy(REPO / "jobs" / "examples" / "edits.parquet", examples / "edits.parquet")
    (tmp_path / "edit.yaml").write_text(job)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")} | LOOPBACK_ENV
    ditfleet = [sys.executable, "-m", "ditfleet.jobs.cli"]
    done = subprocess.run(
        [*ditfleet, "run", "edit.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    out = tmp_path / "out" / "tiny-edit"
    rows = ds.dataset(out / "manifests", format="parquet").to_table().to_pylist()
    source = {r["id"]: r for r in pq.read_table(examples / "edits.parquet").to_pylist()}
    assert sorted(r["id"] for r in rows) == sorted(source) and {r["status"] for r in rows} == {"ok"}
    images, pairs = [], []
    for row in rows:
        given = source[row["id"]]["image"]
        (uri,) = row["source_uris"]  # embedded: named by its input row, not its struct's bare path
        assert uri.startswith(f"{examples / 'edits.parquet'}#row=") and uri.endswith("&image=0")
        assert row["source_sha256"] == [hashlib.sha256(given["bytes"]).hexdigest()]
        with Image.open(row["uri"]) as image, Image.open(io.BytesIO(given["bytes"])) as src:
            assert image.size == src.size  # its bucket is its source's: 128x128, 160x96 or 96x160
            pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        extra = json.loads(row["extra"])
        pairs.append((parse_caption(extra["scene"]), parse_instruction(row["prompt"])))
        images.append(pixels.permute(2, 0, 1))
    by_size: dict = {}
    for image, pair in zip(images, pairs):
        by_size.setdefault(tuple(image.shape), ([], []))
        by_size[tuple(image.shape)][0].append(image)
        by_size[tuple(image.shape)][1].append(pair)
    passed = sum(edit_score(torch.stack(ims), ps)["adherence"] * len(ps) for ims, ps in by_size.values())
    print(f"README edit job: {passed:.0f} of {len(rows)} edits pass the adherence check")
    assert passed / len(rows) >= FLOOR, passed
    assert (
        subprocess.run([*ditfleet, "verify", str(out)], env=env, capture_output=True, timeout=300).returncode
        == 0
    )
