"""Issue 48, item 2: ids that differ only in case on an output whose store folds case.

On a macOS or Windows volume (or an SMB share of one) "Cat.png" and "cat.png" are one file: in the
"files" format the rows "Cat" and "cat" of one shard wrote one object, the second image replacing
the first, both rows committed naming it, and the run ended 0. A run now probes the store when it
claims the output and refuses such ids before writing anything of the job, naming both rows.

No filesystem that folds case can be made on this test machine (its kernel has no CONFIG_UNICODE,
so an ext4 `-O casefold` loop image does not mount; no vfat, no FUSE library), so the output
folder folds case by LocalStore's own path resolution: `folding_output` makes every LocalStore
under it resolve each path component to the entry already there whose name equals it ignoring
case (case-preserving and case-insensitive, as APFS and NTFS are). The driver, the stand-in
worker (tests/support/format_worker.py) and the real "files" writer all go through it.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ditfleet.driver.run_job as run_job_module
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.output.case_fold import store_folds_case
from ditfleet.workers.output.formats import object_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import LocalStore, open_store
from tests.support.fence_entry import driver_config, in_process, worker_config
from tests.support.format_worker import FormatWorker
from tests.support.worker_fixtures import write_prompts

IDS = ["Cat", "cat", "dog", "DOG-2", "bird", "Bird"]


@pytest.fixture
def folding_output(tmp_path, monkeypatch) -> Path:
    """An output folder that folds case for every LocalStore under it (see the module docstring)."""
    root = tmp_path / "out-folding"
    original = LocalStore._path

    def folded(self: LocalStore, key: str) -> str:
        path = original(self, key)
        if not path.startswith(str(root)):
            return path
        at = str(root)
        for part in Path(path).relative_to(root).parts:
            try:
                match = next((n for n in os.listdir(at) if n.lower() == part.lower()), part)
            except FileNotFoundError:
                match = part
            at = os.path.join(at, match)
        return at

    monkeypatch.setattr(LocalStore, "_path", folded)
    return root


def prompts(tmp_path: Path) -> Path:
    path = write_prompts(tmp_path / "prompts.parquet", len(IDS))
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("id"), "id", pa.array(IDS))
    pq.write_table(table, path)
    return path


def run(tmp_path: Path, out: Path, monkeypatch, output_format: str = "files", incremental: bool = False):
    monkeypatch.setattr(run_job_module, "run_shards", in_process)
    spec = {
        "input": str(prompts(tmp_path)),
        "output": str(out),
        "format": output_format,
        "shard_size": 6,
        "incremental": incremental,
    }
    return run_job_module.run_job(
        driver_config(spec),
        worker_config(spec),
        worker_cls=FormatWorker,
        stream=io.StringIO(),
        interactive=False,
    )


def assert_each_row_names_its_own_image(out: Path) -> None:
    store = open_store(str(out))
    for r in read_manifests(store).to_pylist():
        data = store.get(object_key(str(out), r["uri"])[0])  # type: ignore[arg-type]
        assert hashlib.sha256(data).hexdigest() == r["sha256"], (
            f"row {r['id']!r}: its object {r['uri']} holds another row's image"
        )


def test_the_probe_tells_a_folding_store_from_one_that_keeps_case(tmp_path, folding_output):
    assert store_folds_case(open_store(str(folding_output))) is True
    plain = open_store(str(tmp_path / "plain"))
    assert store_folds_case(plain) is False
    # The probe leaves nothing behind.
    assert list(open_store(str(folding_output)).list()) == [] and list(plain.list()) == []


@pytest.mark.parametrize("incremental", [False, True], ids=["plain", "incremental"])
def test_ids_differing_only_in_case_are_refused_on_a_folding_output(
    tmp_path, folding_output, monkeypatch, incremental
):
    try:
        run(tmp_path, folding_output, monkeypatch, incremental=incremental)
        refused = None
    except InputError as e:
        refused = e
    if folding_output.exists():
        assert_each_row_names_its_own_image(folding_output)  # before the fix: Cat's names cat's image
    assert refused is not None, "the run was not refused"
    message = str(refused)
    assert refused.total == 2, message
    assert "id 'cat' differs only in case from id 'Cat' of" in message and "row 0" in message, message
    assert "id 'Bird' differs only in case from id 'bird'" in message, message
    # Refused before the output was claimed: no _job.json, no lease left held, no object.
    store = open_store(str(folding_output))
    assert not store.exists("_job.json") and not list(store.list("images/")), sorted(store.list())
    assert not list(store.list("_runs/")), sorted(store.list())


def test_the_same_ids_run_where_case_is_kept_or_no_object_is_named_by_an_id(
    tmp_path, folding_output, monkeypatch
):
    # An output that keeps case runs them, each row naming its own image; so does a folding output
    # in a format that holds many images per object (parquet: one data file per shard).
    summary = run(tmp_path, tmp_path / "plain", monkeypatch)
    assert summary.exit_code == 0
    assert_each_row_names_its_own_image(tmp_path / "plain")
    assert run(tmp_path, folding_output, monkeypatch, "parquet").exit_code == 0
    rows = read_manifests(open_store(str(folding_output))).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(IDS) and {r["status"] for r in rows} == {"ok"}


def test_an_s3_output_keeps_case_and_the_probe_leaves_nothing(s3_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/out", s3_server.config())
    assert store_folds_case(store) is False
    assert list(store.list()) == []
