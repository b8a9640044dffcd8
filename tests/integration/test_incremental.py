"""Incremental jobs on a real local Ray with stand-in workers that read the real rows: an input
directory that grows run by run, a crashed run followed by one with a new file, files that change
under uncommitted shards, ids already in the output, and refusal of changed settings."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.output.claim import OutputMismatch
from ditfleet.driver.output.status import output_status
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, run_job
from ditfleet.workers.output.layout import LEASE_PREFIX, RUNS_PREFIX, run_key, success_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import open_store
from tests.support.dispatch_workers import SleepingWorker, SleepingWorkerConfig

pytestmark = pytest.mark.usefixtures("ray_cluster")
ROWS = RowConfig(job_seed=3)


def write_file(path: Path, n: int, ids: list[str] | None = None, num_images: int = 1) -> Path:
    data: dict[str, pa.Array] = {"prompt": pa.array([f"{path.stem} prompt {i}" for i in range(n)])}
    if ids is not None:
        data = {"id": pa.array(ids), **data}
    if num_images != 1:
        data["num_images"] = pa.array([num_images] * n, pa.int64())
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed: a reader never sees half a file (names starting with "." are skipped).
    tmp = path.with_name("." + path.name)
    pq.write_table(pa.table(data), tmp, row_group_size=7)
    os.replace(tmp, path)
    return path


def configs(tmp_path: Path, seed: int = 3, **worker) -> tuple[DriverConfig, SleepingWorkerConfig]:
    out = str(tmp_path / "out")
    rows = RowConfig(job_seed=seed)
    driver = DriverConfig(
        input_uri=str(tmp_path / "in"),
        output_uri=out,
        plan=PlanConfig(rows=rows, shard_size=10),
        dispatch=DispatchConfig(min_actors=1, max_actors=1, num_cpus=0.5, max_attempts=1, tick_s=0.05),
        resolved_spec=json.dumps({"name": "incremental-test"}),
        incremental=True,
    )
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    worker = {"shard_s": 0.02, "marker_dir": str(markers), **worker}
    return driver, SleepingWorkerConfig(out, rows=rows, read_rows=True, **worker)


def run(driver: DriverConfig, worker: SleepingWorkerConfig):
    log = io.StringIO()
    summary = run_job(driver, worker, worker_cls=SleepingWorker, stream=log, interactive=False)
    return summary, log.getvalue()


def shards_run(tmp_path: Path) -> set[int]:
    """Shards the stand-in ran since the last call."""
    path = tmp_path / "markers" / "runs.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.unlink(missing_ok=True)
    return {r["shard"] for r in runs}


def union_ids(out: str) -> list[str]:
    table = read_manifests(open_store(out))
    keys = list(zip(table.column("id").to_pylist(), table.column("k").to_pylist()))
    assert len(keys) == len(set(keys)), "an image appears twice in the union of manifests"
    return sorted(table.column("id").to_pylist())


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every output object's size and mtime, but the driver's lease: each run takes the next
    lease generation (driver/output/lease.py), which is coordination, not output."""
    return {
        key: (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not (key := str(p.relative_to(root))).startswith(LEASE_PREFIX)
    }


def test_growing_directory_three_runs_each_row_once(tmp_path: Path):
    src = tmp_path / "in"
    write_file(src / "2024-06-02.parquet", 23, ids=[f"b{i}" for i in range(23)])
    write_file(src / "2024-06-03.parquet", 12)  # no id column: keyed by file name and row
    driver, worker = configs(tmp_path)

    first, log = run(driver, worker)
    assert first.status == "succeeded" and first.exit_code == 0, log
    assert "run 1: 2 new or changed input file(s), 35 new rows" in log
    assert shards_run(tmp_path) == {0, 1, 2, 3, 4}  # 3 shards over 23 rows, 2 over 12
    expected = sorted([f"b{i}" for i in range(23)] + [f"2024-06-03.parquet#{i}" for i in range(12)])
    assert union_ids(driver.output_uri) == expected
    assert first.rows == {"planned": 35, "ok": 35, "failed": 0}

    # A backfilled day lands; it sorts before the others, which must change nothing made.
    out = Path(driver.output_uri)
    before = {k: v for k, v in snapshot(out).items() if k.startswith(("manifests/", "images/", "_runs/"))}
    write_file(src / "2024-06-01.parquet", 15, ids=[f"a{i}" for i in range(15)])
    second, log = run(driver, worker)
    assert second.status == "succeeded", log
    assert "run 2: 1 new or changed input file(s), 15 new rows (15 images) in shards 00005-00006" in log
    assert shards_run(tmp_path) == {5, 6}, "only the new file's rows are generated"
    after = snapshot(out)
    assert all(after[k] == v for k, v in before.items()), "earlier shards and records are never rewritten"
    expected = sorted(expected + [f"a{i}" for i in range(15)])
    assert union_ids(driver.output_uri) == expected
    assert second.shards["planned"] == 2 and second.rows["ok"] == 15

    # Nothing new: no actors, nothing written (what makes it quick, without timing it).
    before = snapshot(out)
    third, log = run(driver, worker)
    assert third.exit_code == 0 and third.status == "succeeded"
    assert "nothing new in 3 input file(s); all 7 shards committed" in log
    assert shards_run(tmp_path) == set() and third.startup["actors"] == 0
    assert snapshot(out) == before, "a run with nothing new writes nothing"
    assert union_ids(driver.output_uri) == expected

    status = output_status(open_store(driver.output_uri)).to_dict()
    assert status["complete"] and status["runs"] == 2
    assert status["shards"] == {"planned": 7, "committed": 7, "left": 0}
    assert status["rows"] == {"planned": 50, "ok": 50, "failed": 0}
    records = sorted(p.name for p in (out / RUNS_PREFIX).iterdir() if p.suffix == ".json")
    assert records == ["00001.json", "00002.json"]
    second_record = json.loads((out / run_key(2)).read_text())
    assert [(s["index"], s["row_start"], s["row_stop"]) for s in second_record["shards"]] == [
        (5, 0, 10),
        (6, 10, 15),
    ]


def test_crashed_run_then_a_new_file_does_the_old_shards_once(tmp_path: Path):
    src = tmp_path / "in"
    write_file(src / "day1.parquet", 30, ids=[f"d1-{i}" for i in range(30)])
    driver, failing = configs(tmp_path, fail={1: -1})  # shard 1 fails on every attempt
    first, log = run(driver, failing)
    assert first.status == "failed" and [f["shard"] for f in first.failed_shards] == [1], log
    assert not open_store(driver.output_uri).exists(success_key())
    assert output_status(open_store(driver.output_uri)).missing == [1]
    shards_run(tmp_path)

    write_file(src / "day2.parquet", 14, ids=[f"d2-{i}" for i in range(14)])
    _, healthy = configs(tmp_path)
    second, log = run(driver, healthy)
    assert second.status == "succeeded", log
    assert "1 shard(s) of earlier runs not committed yet: running them now" in log
    assert shards_run(tmp_path) == {1, 3, 4}, "the left-over shard keeps its number; new ones follow"
    assert union_ids(driver.output_uri) == sorted(
        [f"d1-{i}" for i in range(30)] + [f"d2-{i}" for i in range(14)]
    )
    assert second.shards["planned"] == 3 and second.rows["ok"] == 10 + 14
    assert output_status(open_store(driver.output_uri)).to_dict()["complete"]


def test_ids_already_in_the_output_are_left_out_and_changed_files_replanned(tmp_path: Path):
    src = tmp_path / "in"
    write_file(src / "dump-1.parquet", 20, ids=[f"p{i}" for i in range(20)])
    write_file(src / "loose.parquet", 8)
    driver, failing = configs(tmp_path, fail={2: -1})  # loose.parquet's shard stays uncommitted
    first, _ = run(driver, failing)
    assert [f["shard"] for f in first.failed_shards] == [2]
    shards_run(tmp_path)

    # A cumulative dump (every earlier id and 12 new ones), and loose.parquet rewritten with
    # 3 more rows before its shard was ever committed.
    write_file(src / "dump-2.parquet", 32, ids=[f"p{i}" for i in range(32)])
    write_file(src / "loose.parquet", 11)
    _, healthy = configs(tmp_path)
    second, log = run(driver, healthy)
    assert second.status == "succeeded", log
    assert "20 rows left out (their ids are in the output already)" in log
    assert "1 uncommitted shard(s) of earlier runs given up" in log
    assert 2 not in shards_run(tmp_path), "a shard over a changed file is not run as planned"
    expected = [f"p{i}" for i in range(32)] + [f"loose.parquet#{i}" for i in range(11)]
    assert union_ids(driver.output_uri) == sorted(expected)
    status = output_status(open_store(driver.output_uri)).to_dict()
    assert status["complete"] and status["rows"]["planned"] == 43 and status["shards"]["left"] == 0


def test_changed_settings_or_mode_are_refused_naming_what_differs(tmp_path: Path):
    write_file(tmp_path / "in" / "a.parquet", 5)
    driver, worker = configs(tmp_path)
    assert run(driver, worker)[0].exit_code == 0
    store = open_store(driver.output_uri)
    job_before = store.get("_job.json")

    other, other_worker = configs(tmp_path, seed=9)
    with pytest.raises(OutputMismatch) as err:
        run(other, other_worker)
    assert "job_seed: 3 in the existing output, 9 now" in str(err.value)
    assert "Write to a new output" in str(err.value)

    plain = DriverConfig(**{**vars(driver), "incremental": False})
    with pytest.raises(OutputMismatch) as err:
        run(plain, worker)
    assert "made by an incremental job (input.incremental: true)" in str(err.value)
    assert store.get("_job.json") == job_before and not list(store.list(RUNS_PREFIX + "00002"))

    # A new file with a bad row: the run fails before writing anything, naming the row.
    pq.write_table(pa.table({"prompt": ["fine", " "]}), tmp_path / "in" / "bad.parquet")
    before = snapshot(Path(driver.output_uri))
    with pytest.raises(InputError) as err:
        run(driver, worker)
    assert "bad.parquet: row 1, column 'prompt': prompt is empty" in str(err.value)
    assert snapshot(Path(driver.output_uri)) == before
    (tmp_path / "in" / "bad.parquet").unlink()

    # A new shard size is fine: each run records its own shards.
    write_file(tmp_path / "in" / "b.parquet", 4)
    resized = DriverConfig(**{**vars(driver), "plan": PlanConfig(rows=ROWS, shard_size=2)})
    summary, _ = run(resized, worker)
    assert summary.exit_code == 0 and summary.shards["planned"] == 2


@pytest.mark.slow
def test_real_worker_through_the_cli_adds_a_days_file(random_model_dir, tmp_path: Path, capsys):
    from ditfleet.jobs.cli import main
    from ditfleet.workers.rows import derive_seed
    from tests.support.worker_fixtures import write_prompts

    src, out = tmp_path / "in", tmp_path / "out"
    write_prompts(src / "day-1.parquet", 10)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: nightly\ninput: {{path: {src}, incremental: true}}\noutput: {{uri: {out}}}\n"
        f"model: {{path: {random_model_dir}}}\nsampling: {{steps: 2, seed: 7}}\n"
        "buckets: {names: [32x32, 48x32]}\ncompile: {vae: false}\n"
        "workers: {min: 1, gpus: 0, cpus: 1, batch_size: 8}\nshards: {size: 6}\n"
    )
    assert main(["run", str(job)]) == 0, capsys.readouterr().err
    store = open_store(str(out))
    first = {r["id"]: r["sha256"] for r in read_manifests(store).select(["id", "sha256"]).to_pylist()}
    assert sorted(first) == [f"p{i:05d}" for i in range(10)]

    write_file(src / "day-2.parquet", 5)  # no id column
    capsys.readouterr()
    assert main(["plan", str(job), "--json"]) == 0  # what the next run adds; writes nothing
    preview = json.loads(capsys.readouterr().out)
    assert (preview["next_run"], preview["new_shards"], preview["rows"]) == (2, 1, 5)
    assert not (out / "_runs" / "00002.json").exists()
    assert main(["run", str(job)]) == 0
    err = capsys.readouterr().err
    assert "run 2: 1 new or changed input file(s), 5 new rows (5 images) in shards 00002-00002" in err
    table = read_manifests(store)
    rows = {r["id"]: r for r in table.select(["id", "sha256", "seed", "status", "shard"]).to_pylist()}
    assert len(rows) == table.num_rows == 15 and {r["status"] for r in rows.values()} == {"ok"}
    assert {k: rows[k]["sha256"] for k in first} == first, "the first run's images are untouched"
    for i in range(5):  # the worker resolves the ids the planner keyed the rows by
        row = rows[f"day-2.parquet#{i}"]
        assert row["shard"] == 2 and row["seed"] == derive_seed(7, f"day-2.parquet#{i}")

    assert main(["run", str(job)]) == 0
    assert "nothing new in 2 input file(s); all 3 shards committed" in capsys.readouterr().err
    assert main(["status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["complete"] and status["images"] == {"planned": 15, "ok": 15, "failed": 0}
    # verify takes the plan of an incremental output from its run records.
    assert main(["verify", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 15 and report["shards"] == {"planned": 3, "committed": 3, "missing": 0}
    assert report["objects_checked"] == 15 and not report["problems"]


class _KilledAfter:
    """The output store of a driver that is killed (raises) after `writes` writes or deletes."""

    def __init__(self, store, writes: int) -> None:
        self._store, self._left = store, writes

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name not in ("put", "put_if_absent", "delete", "put_file"):
            return attr

        def write(*args, **kwargs):
            if self._left == 0:
                raise KeyboardInterrupt("driver killed")
            self._left -= 1
            return attr(*args, **kwargs)

        return write


def _success_with_uncommitted_shards(out: str) -> list[int]:
    """Planned shards without a manifest, if _SUCCESS is there (else [])."""
    from ditfleet.driver.run_records import RecordedPlan, read_run_records
    from ditfleet.workers.output.manifest import committed_shards

    store = open_store(out)
    if not store.exists(success_key()):
        return []
    planned = {s.index for s in RecordedPlan.of(read_run_records(store)).live()}
    return sorted(planned - committed_shards(store))


def test_success_never_stands_next_to_uncommitted_shards_wherever_the_driver_dies(tmp_path: Path):
    from ditfleet.driver.increment import commit_increment, plan_increment
    from ditfleet.driver.output.claim import claim_incremental_output
    from ditfleet.driver.run_job import prompt_source
    from ditfleet.workers.output.manifest import committed_shards

    src = tmp_path / "in"
    write_file(src / "day1.parquet", 12, ids=[f"d1-{i}" for i in range(12)])
    driver, worker = configs(tmp_path)
    assert run(driver, worker)[0].status == "succeeded"
    write_file(src / "day2.parquet", 9, ids=[f"d2-{i}" for i in range(9)])
    out = driver.output_uri
    spec = json.loads(driver.resolved_spec)
    for writes in range(6):  # killed after 0, 1, 2, ... writes of the planning step
        store = open_store(out)
        assert store.exists(success_key()) or writes > 0
        fingerprint = claim_incremental_output(store, driver.plan, driver.input_uri, spec, write=False)
        plan = plan_increment(prompt_source(driver), driver.plan, store, committed_shards(store), fingerprint)
        try:
            done = commit_increment(_KilledAfter(store, writes), plan)
        except KeyboardInterrupt:
            done = None
        assert _success_with_uncommitted_shards(out) == [], f"killed after {writes} writes"
        if done is not None:
            break
    else:
        raise AssertionError("planning never finished")
    assert not open_store(out).exists(success_key())
    second, log = run(driver, worker)  # the run that was killed is run again: it completes
    assert second.status == "succeeded", log
    assert open_store(out).exists(success_key()) and _success_with_uncommitted_shards(out) == []


def test_a_stale_success_is_removed_before_carried_shards_run(tmp_path: Path):
    """An output that an older driver left with _SUCCESS next to an uncommitted shard."""
    src = tmp_path / "in"
    write_file(src / "day1.parquet", 30, ids=[f"d1-{i}" for i in range(30)])
    driver, failing = configs(tmp_path, fail={1: -1})
    assert run(driver, failing)[0].status == "failed"
    store = open_store(driver.output_uri)
    store.put(success_key(), b"{}")  # what a driver killed between record and delete left behind
    assert _success_with_uncommitted_shards(driver.output_uri) == [1]
    again, log = run(driver, failing)  # nothing new; shard 1 is carried over and fails again
    assert again.status == "failed" and "running them now" in log
    assert not store.exists(success_key())
