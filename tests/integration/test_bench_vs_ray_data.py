"""bench/vs_ray_data.py at a smoke size: both paths (ditfleet, and Ray Data map_batches over
diffusers) store every image once on a real local Ray and a real S3 server, and ditfleet's
images are diffusers' for the same seeds.

The benchmark starts its own Ray, S3 server and drivers, so it runs as a child process in its
own session; the test stops that whole group if it runs over time.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.fixtures_ray import run_own_cluster
from tests.support.paths import REPO

pytestmark = pytest.mark.slow
IMAGES = 8


def test_both_paths_store_every_image_and_match_diffusers():
    cmd = [sys.executable, str(REPO / "bench" / "vs_ray_data.py"), "--model", "random"]
    cmd += ["--images", str(IMAGES), "--buckets", "64x64,80x48", "--steps", "2", "--actors", "1"]
    cmd += ["--batch-size", "4", "--shard-size", "4", "--rows-per-block", "4"]
    cmd += ["--rounds", "1", "--no-kill", "--no-profile", "--timeout-s", "150"]
    returncode, out, err = run_own_cluster(cmd, REPO, dict(os.environ), timeout_s=300)
    assert returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert "ditfleet" in out and "ray data + diffusers" in out, "the table is printed"

    for name in ("ditfleet-clean", "ray_data-clean"):
        run = result["runs"][name]
        assert run["returncode"] == 0, f"{name}: see {run['log']}"
        assert run["images_stored"] == IMAGES, name
        assert run["metadata_rows"] == IMAGES, name
        assert run["rows_lost"] == 0 and run["rows_duplicated"] == 0, name
        assert run["first_image_s"] is not None and run["first_image_s"] <= run["wall_s"], name
        assert run["driver_peak_rss_mb"] > 0 and run["actor_peak_rss_mb"] > 0, name

    identity = result["identity"]
    assert identity["compared"] == IMAGES
    assert identity["shape_mismatches"] == []
    assert identity["max_abs_diff"] <= 2, "ditfleet's images must be diffusers' within float noise (2/255)"
