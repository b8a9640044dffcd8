"""`ditfleet verify`: a real output (the worker on the tiny random model, the driver's finish)
checks clean; each kind of damage is found and named; orphans are cleaned, nothing else is."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.verify import verify_output
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, claim_output, plan_input
from ditfleet.jobs.cli import main
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.formats.parquet import data_key
from ditfleet.workers.output.formats.webdataset import webdataset_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token, success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.worker_fixtures import finish_like_driver, row_config, worker_config, write_prompts

ROWS, SHARD_SIZE = 6, 2


def _make_output(root: Path, model_dir: Path, prompts: Path, output_format: str) -> dict[int, str]:
    """Plan, claim, run every shard on the real worker, finish as the driver does. Returns the
    committed attempt token per shard."""
    config = DriverConfig(
        input_uri=str(prompts),
        output_uri=str(root),
        plan=PlanConfig(rows=row_config(), shard_size=SHARD_SIZE),
    )
    plan = plan_input(config)
    store = open_store(str(root))
    claim_output(store, plan, {})
    worker = GenerationWorker(worker_config(model_dir, str(root), output_format=output_format))
    tokens = {s.index: worker.run_shard(s, 0).attempt_token for s in plan.shards}
    finish_like_driver(store, plan)
    return tokens


@pytest.fixture(scope="module")
def outputs(random_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("verify")
    prompts = write_prompts(base / "prompts.parquet", ROWS)
    made = {}
    for fmt in ("files", "parquet", "webdataset"):
        made[fmt] = (base / fmt, _make_output(base / fmt, random_model_dir, prompts, fmt))
    return made


@pytest.fixture
def output(outputs, tmp_path, request):
    """A fresh copy of the output of the format the test asks for: (root, store, tokens)."""
    fmt = getattr(request, "param", "files")
    src, tokens = outputs[fmt]
    root = tmp_path / fmt
    shutil.copytree(src, root)
    return root, open_store(str(root)), tokens


def _problems(store, **kwargs) -> str:
    report = verify_output(store, **kwargs)
    assert report.exit_code == 1 and report.problems, report.format_text()
    return "\n".join(report.problems)


@pytest.mark.parametrize("output", ["files", "parquet", "webdataset"], indirect=True)
def test_a_finished_output_verifies_clean(output, capsys):
    root, store, _ = output
    report = verify_output(store)
    assert report.exit_code == 0, report.format_text()
    assert report.moved_from and report.moved_from != str(root)  # a copy: keys found by the layout
    assert report.complete and report.rows == ROWS and report.images_ok == ROWS
    assert report.objects_checked == ROWS and not report.orphans and report.pending == 0
    assert main(["verify", str(root)]) == 0
    assert "OK" in capsys.readouterr().out


def test_a_changed_image_is_found(output):
    _, store, tokens = output
    key = image_key(1, tokens[1], "p00002", None, "png")
    store.put(key, store.get(key) + b"\0")
    assert f"{store.uri(key)}: " in _problems(store) and "sha256" in _problems(store)


def test_a_missing_image_is_found(output):
    _, store, tokens = output
    key = image_key(0, tokens[0], "p00001", None, "png")
    store.delete(key)
    assert f"{store.uri(key)}: missing" in _problems(store)


@pytest.mark.parametrize("output", ["parquet"], indirect=True)
def test_a_changed_row_in_a_data_file_is_found(output):
    _, store, tokens = output
    key = data_key(2, tokens[2])
    table = read_parquet(store.get(key))
    images = table.column("image").to_pylist()
    images[0] = {"bytes": images[0]["bytes"][:-1], "path": images[0]["path"]}
    table = table.set_column(0, "image", pa.array(images, table.schema.field("image").type))
    buf = io.BytesIO()
    pq.write_table(table, buf)
    store.put(key, buf.getvalue())
    assert "image of row id='p00004'" in _problems(store)


@pytest.mark.parametrize("output", ["webdataset"], indirect=True)
def test_a_tar_missing_a_member_is_found(output):
    _, store, tokens = output
    key = webdataset_key(0, tokens[0])
    with tarfile.open(fileobj=io.BytesIO(store.get(key))) as tar:
        kept = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if not m.name.startswith("p00000")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m, data in kept:
            tar.addfile(m, io.BytesIO(data))
    store.put(key, buf.getvalue())
    assert "has no image for manifest row id='p00000'" in _problems(store)


def test_a_row_in_two_manifests_is_found(output):
    _, store, _ = output
    table = read_parquet(store.get(manifest_key(0)))
    moved = table.set_column(
        table.schema.get_field_index("shard"), "shard", pa.array([1] * table.num_rows, pa.int32())
    )
    buf = io.BytesIO()
    pq.write_table(moved.cast(MANIFEST_SCHEMA), buf)
    store.put(manifest_key(1), buf.getvalue())
    problems = _problems(store)
    assert "row id='p00000' k=0 is in 2 manifests" in problems
    assert "the manifests hold 4 rows / 6 images, the plan has 6 / 6" in problems  # shard 1's own are gone


def test_a_lost_manifest_with_success_present_is_found_and_partial_allows_running(output, capsys):
    root, store, _ = output
    store.delete(manifest_key(2))
    assert "_SUCCESS is present but 1 planned shards are not committed" in _problems(store)
    store.delete(success_key())
    report = verify_output(store)
    assert report.exit_code == 1 and not report.problems and report.missing == [2]  # incomplete
    assert "not complete" in report.format_text()
    # A running output: what is committed is checked, what is not yet is fine.
    assert verify_output(store, partial=True).exit_code == 0
    assert main(["verify", str(root), "--partial", "--json"]) == 0
    assert '"missing": 1' in capsys.readouterr().out


def test_strays_and_foreign_manifests_are_problems(output):
    _, store, _ = output
    store.put("images/00000/junk.png", b"x")
    store.put(manifest_key(9), store.get(manifest_key(0)))
    store.put("manifests/notes.txt", b"x")
    problems = _problems(store)
    assert "images/00000/junk.png: stray object" in problems
    assert "manifest of shard 9, which the plan does not have" in problems
    assert "manifests/notes.txt: stray file" in problems


def test_success_with_wrong_counts_is_found(output):
    _, store, _ = output
    doc = json.loads(store.get(success_key()))
    doc["images"]["ok"] -= 1
    store.put(success_key(), json.dumps(doc).encode())
    assert "_SUCCESS says 5 images ok" in _problems(store)


def test_orphans_are_harmless_and_clean_deletes_only_them(output, capsys):
    root, store, tokens = output
    late = new_attempt_token(7)
    orphan = image_key(1, late, "p00002", None, "png")  # a late run of a committed shard
    store.put(orphan, b"late bytes")
    store.delete(manifest_key(2))  # shard 2 is not committed: its runs' objects are in play
    store.delete(success_key())
    pending = image_key(2, late, "p00004", None, "png")
    store.put(pending, b"in progress")
    report = verify_output(store, partial=True)
    assert report.exit_code == 0 and report.orphans == [orphan] and report.pending >= 1, report.format_text()
    assert main(["verify", str(root), "--partial", "--clean"]) == 0
    assert "1 deleted" in capsys.readouterr().out
    assert not store.exists(orphan) and store.exists(pending)
    assert store.exists(image_key(1, tokens[1], "p00002", None, "png"))
    assert verify_output(store, partial=True).orphans == []


def test_not_an_output(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["verify", str(tmp_path / "x")]) == 1
    assert "_job.json is missing" in capsys.readouterr().out


def test_manifest_with_rows_of_another_shard(output):
    _, store, _ = output
    table = read_parquet(store.get(manifest_key(0)))
    shard = pc.if_else(pc.equal(table.column("id"), "p00001"), 5, table.column("shard")).cast(pa.int32())
    table = table.set_column(table.schema.get_field_index("shard"), "shard", shard)
    buf = io.BytesIO()
    pq.write_table(table.cast(MANIFEST_SCHEMA), buf)
    store.put(manifest_key(0), buf.getvalue())
    assert "holds rows of shards [0, 5], not only 0" in _problems(store)
