"""`ditfleet verify --ray`: the per-shard checks as Ray tasks give the report the threads give,
on a clean output and on hostile ones (a changed, a missing and a stray object, a stray manifest,
with a row in two manifests, a uri outside the output and losing-run orphans built into every
case), on a local store and on S3; `--clean` deletes what the threaded path deletes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from ditfleet.driver.output.verify import verify_output
from ditfleet.driver.output.verify_ray import RayChecks
from ditfleet.jobs.cli import main
from ditfleet.workers.storage import open_store
from tests.unit.driver.test_verify_parallel import IMAGES, SHARDS, _build, _harm

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize(
    "case", ["clean", "changed object", "missing object", "stray object", "stray manifest"]
)
def test_ray_tasks_give_the_threaded_report(tmp_path: Path, case: str):
    store, keys = _build(tmp_path)
    _harm(tmp_path, store, keys, case)
    threaded = verify_output(store, partial=True, workers=4).to_dict()
    # 5 groups for 12 shards: uneven groups, several per task.
    ray = verify_output(store, partial=True, shard_checks=RayChecks(str(tmp_path), groups=5)).to_dict()
    assert ray == threaded
    assert threaded["objects_checked"] > 0 and any("r002-007" in p for p in threaded["problems"])


def test_the_cli_with_ray_prints_the_threaded_json(tmp_path: Path, capsys):
    store, keys = _build(tmp_path)
    _harm(tmp_path, store, keys, "changed object")
    assert main(["verify", str(tmp_path), "--partial", "--json"]) == 1
    threaded = json.loads(capsys.readouterr().out)
    assert main(["verify", str(tmp_path), "--partial", "--json", "--ray"]) == 1
    assert json.loads(capsys.readouterr().out) == threaded
    assert keys[(1, 3)] in "\n".join(threaded["problems"])


def test_ray_clean_deletes_what_the_threaded_clean_deletes(tmp_path: Path):
    a, _ = _build(tmp_path / "a")
    b, _ = _build(tmp_path / "b")
    ra = verify_output(a, partial=True, clean=True)
    rb = verify_output(b, partial=True, clean=True, shard_checks=RayChecks(str(tmp_path / "b"), groups=3))
    assert ra.cleaned == rb.cleaned == (SHARDS - 1) * (IMAGES // 5)
    assert len(list(a.list("images/"))) == len(list(b.list("images/")))


def test_ray_tasks_open_an_s3_output_from_its_uri_and_settings(tmp_path: Path, s3_server):
    local, keys = _build(tmp_path)
    _harm(tmp_path, local, keys, "missing object")
    bucket = f"verify-ray-{uuid.uuid4().hex[:12]}"
    s3_server.admin.create_bucket(Bucket=bucket)
    s3 = s3_server.config(max_attempts=3)
    uri = f"s3://{bucket}/out"
    store = open_store(uri, s3)
    for key in local.list(""):
        store.put(key, local.get(key))
    threaded = verify_output(store, partial=True).to_dict()
    assert verify_output(store, partial=True, shard_checks=RayChecks(uri, s3, groups=4)).to_dict() == threaded
    assert any(keys[(5, 9)] in p for p in threaded["problems"])


def test_an_address_without_ray_is_bad_usage(tmp_path: Path, capsys):
    _build(tmp_path)
    assert main(["verify", str(tmp_path), "--address", "127.0.0.1:1"]) == 2
    assert "--ray" in capsys.readouterr().err
