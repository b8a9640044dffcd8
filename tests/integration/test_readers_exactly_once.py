"""Issue 32, scenario 5: each reader the README and docs show, in the form they show it, sees
every row of a finished output exactly once and no row naming a missing object: after a normal
run, after a redo of a shard (`--redo-shards 1`), and after a redo whose driver was killed right
after its commit followed by a plain rerun.

- pyarrow.dataset over manifests/: `ds.dataset("<out>/manifests", format="parquet").to_table()`
  (README.md, "Output")
- DuckDB over manifests/: `read_parquet('<out>/manifests/*.parquet')` (bench/manifest_read.py)
- Hugging Face `datasets` over data/: `load_dataset("parquet", data_files="<out>/data/*.parquet")`
- WebDataset over webdataset/: every `<out>/webdataset/*.tar`, samples grouped by the key before
  the first "." of a member's name, as WebDataset does

The outputs are made by driver processes (tests/support/fence_entry.py, the stand-in worker that
stores real data files and tars), 3 shards of 2 rows, one per output format and history.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from ditfleet.workers.output.formats import object_key
from tests.support.paused_process import Processes
from tests.support.worker_fixtures import write_prompts

ROWS, SHARD_SIZE = 6, 2
IDS = [f"p{i:05d}" for i in range(ROWS)]
HISTORIES = ("normal", "redo", "killed_redo_then_rerun")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(format, history) -> a finished output folder, made once per module when first asked."""
    base = tmp_path_factory.mktemp("readers")
    prompts = write_prompts(base / "prompts.parquet", ROWS)
    made: dict[tuple[str, str], Path] = {}
    started: list[Processes] = []

    def make(output_format: str, history: str) -> Path:
        if (output_format, history) in made:
            return made[output_format, history]
        out = base / f"{output_format}-{history}"
        procs = Processes(
            base / f"procs-{output_format}-{history}",
            {
                "input": str(prompts),
                "output": str(out),
                "format": output_format,
                "shard_size": SHARD_SIZE,
            },
        )
        started.append(procs)
        done = procs.run("run")
        assert done.rc == 0, done
        if history == "redo":
            done = procs.run("redo", redo=[1])
            assert done.rc == 0, done
        elif history == "killed_redo_then_rerun":
            redo = procs.start("redo", redo=[1], pause_at=["after_redo_commit"])
            redo.wait_paused("after_redo_commit")
            redo.kill()
            done = procs.run("rerun")
            assert done.rc == 0, done
        assert (out / "_SUCCESS").exists()
        made[output_format, history] = out
        return out

    try:
        yield make
    finally:
        for procs in started:
            procs.close()


def assert_manifest_rows(out: Path, rows: list[dict]) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    seen = Counter(r["id"] for r in ok)
    problems = []
    if twice := sorted(i for i, n in seen.items() if n > 1):
        problems.append(f"rows seen more than once: {twice}")
    if sorted(seen) != IDS:
        problems.append(f"rows seen: {sorted(seen)}, not the input's {IDS}")
    if missing := sorted({r["uri"] for r in ok if not (out / object_key(str(out), r["uri"])[0]).exists()}):
        problems.append(f"rows name objects that are gone: {[os.path.relpath(m, out) for m in missing]}")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("history", HISTORIES)
def test_pyarrow_dataset_over_manifests(outputs, history):
    import pyarrow.dataset as ds

    out = outputs("parquet", history)
    table = ds.dataset(f"{out}/manifests", format="parquet").to_table()
    assert_manifest_rows(out, table.select(["id", "status", "uri"]).to_pylist())


@pytest.mark.parametrize("history", HISTORIES)
def test_duckdb_over_manifests(outputs, history):
    import duckdb

    out = outputs("parquet", history)
    with duckdb.connect() as con:
        result = con.execute(f"SELECT id, status, uri FROM read_parquet('{out}/manifests/*.parquet')")
        names = [d[0] for d in result.description]
        rows = [dict(zip(names, r)) for r in result.fetchall()]
    assert_manifest_rows(out, rows)


@pytest.mark.parametrize("history", HISTORIES)
def test_datasets_over_data(outputs, history, tmp_path):
    import datasets

    datasets.disable_progress_bars()
    out = outputs("parquet", history)
    rows = datasets.load_dataset(
        "parquet", data_files=f"{out}/data/*.parquet", split="train", cache_dir=str(tmp_path / "hf")
    )
    ids = Counter(rows["id"])
    assert not [i for i, n in ids.items() if n > 1], f"rows seen more than once: {sorted(ids.elements())}"
    assert sorted(ids) == IDS
    assert all(image is not None for image in rows["image"])  # each row holds its image


@pytest.mark.parametrize("history", HISTORIES)
def test_webdataset_over_tars(outputs, history):
    out = outputs("webdataset", history)
    samples: Counter[str] = Counter()
    for path in sorted(glob.glob(f"{out}/webdataset/*.tar")):
        with tarfile.open(path) as tar:
            members: dict[str, set[str]] = {}
            for member in tar.getmembers():
                key, ext = os.path.basename(member.name).split(".", 1)
                members.setdefault(key, set()).add(ext)
                assert tar.extractfile(member).read(), member.name
            for key, exts in members.items():
                assert "json" in exts and len(exts) == 2, (path, key, exts)  # {key}.png + {key}.json
                samples[key] += 1
    assert not [k for k, n in samples.items() if n > 1], (
        f"samples seen more than once: {sorted(samples.elements())}"
    )
    assert sorted(samples) == IDS


def test_readers_agree_on_the_images(outputs):
    """The images the data/ reader gets are those the manifests/ reader's rows describe."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    out = outputs("parquet", "redo")
    manifest = {
        r["id"]: r
        for r in ds.dataset(f"{out}/manifests", format="parquet").to_table().to_pylist()
        if r["status"] == "ok"
    }
    for path in glob.glob(f"{out}/data/*.parquet"):
        for row in pq.read_table(path).to_pylist():
            assert manifest[row["id"]]["uri"] == path, (row["id"], path)
            assert manifest[row["id"]]["sha256"] == row["sha256"]
            assert io.BytesIO(row["image"]["bytes"]).read(8) == b"\x89PNG\r\n\x1a\n"
