"""run_job on a real local Ray with stand-in workers: resume, refusal of another job's output,
_SUCCESS and the summary, and the progress output."""

from __future__ import annotations

import dataclasses
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.output.status import output_status
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.plan_file import PLAN_KEY
from ditfleet.driver.run_job import DriverConfig, OutputMismatch, run_job
from ditfleet.workers.output.layout import job_key, manifest_key, success_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import open_store
from tests.support.dispatch_workers import SleepingWorker, SleepingWorkerConfig

pytestmark = pytest.mark.usefixtures("ray_cluster")


def write_prompts(path, n: int) -> str:
    pq.write_table(pa.table({"prompt": [f"a small red circle number {i}" for i in range(n)]}), path)
    return str(path)


def configs(tmp_path, seed: int = 0, **worker):
    out = str(tmp_path / "out")
    driver = DriverConfig(
        input_uri=str(tmp_path / "prompts.parquet"),
        output_uri=out,
        plan=PlanConfig(rows=RowConfig(job_seed=seed), shard_size=5),
        # No tail speculation: a queued shard moved to an idle actor is a second attempt, and the
        # test counts attempts (a slow first actor on a loaded machine would move some).
        dispatch=DispatchConfig(
            min_actors=2, max_actors=2, num_cpus=0.5, max_attempts=1, tick_s=0.05, speculative_tail=False
        ),
        resolved_spec=json.dumps({"name": "test"}),
    )
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    return driver, SleepingWorkerConfig(out, shard_s=0.02, marker_dir=str(markers), **worker)


def runs_logged(tmp_path) -> list[dict]:
    path = tmp_path / "markers" / "runs.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.unlink(missing_ok=True)
    return runs


def test_resume_runs_only_what_is_left_and_refuses_another_job(tmp_path):
    write_prompts(tmp_path / "prompts.parquet", 40)  # 8 shards of 5 rows
    driver, worker = configs(tmp_path, fail={3: -1, 6: -1})
    log = io.StringIO()
    first = run_job(driver, worker, worker_cls=SleepingWorker, stream=log, interactive=False)
    assert first.status == "failed" and first.exit_code == 1
    assert [f["shard"] for f in first.failed_shards] == [3, 6]
    assert first.shards == {
        "planned": 8, "committed": 6, "committed_before": 0, "committed_now": 6, "failed": 2, "left": 2
    }  # fmt: skip
    assert first.failures_by_error == {"shard failed: RuntimeError": 2}
    store = open_store(driver.output_uri)
    assert not store.exists(success_key()), "_SUCCESS only when every shard is committed"
    text = log.getvalue()
    assert "shard 00003: FAILED after 1 attempt: RuntimeError: injected failure of shard 3 attempt 0" in text
    assert "Run the same command again" in text
    assert sorted({r["shard"] for r in runs_logged(tmp_path)}) == list(range(8))

    status = output_status(store)
    assert status.missing == [3, 6] and status.counts.rows_ok == 30

    _, healthy = configs(tmp_path)
    second = run_job(driver, healthy, worker_cls=SleepingWorker, stream=io.StringIO(), interactive=False)
    # (a shard may run twice: the tail moves or duplicates runs onto idle actors)
    assert {r["shard"] for r in runs_logged(tmp_path)} == {3, 6}, "only the shards left run again"
    assert second.status == "succeeded" and second.exit_code == 0
    assert second.shards["committed_before"] == 6 and second.shards["committed_now"] == 2
    assert second.rows == {"planned": 40, "ok": 40, "failed": 0}
    written = json.loads(store.get(success_key()))
    assert written["status"] == "succeeded" and written["images"]["ok"] == 40
    assert set(written["workers"]) and all(w["images_per_s"] > 0 for w in written["workers"].values())

    log = io.StringIO()
    third = run_job(driver, healthy, worker_cls=SleepingWorker, stream=log, interactive=False)
    assert "already complete" in log.getvalue() and runs_logged(tmp_path) == []
    assert third.status == "succeeded"

    other, other_worker = configs(tmp_path, seed=7)
    before = store.get(job_key())
    with pytest.raises(OutputMismatch) as err:
        run_job(other, other_worker, worker_cls=SleepingWorker, stream=io.StringIO())
    assert "job_seed: 0 in the existing output, 7 now" in str(err.value)
    assert store.get(job_key()) == before


def test_a_resume_refuses_rows_edited_in_place_under_the_same_footer(tmp_path):
    """A same-length prompt edit of an uncompressed file keeps its size, rows and footer, so the
    stored plan is taken; the actor digests the shard's rows, finds them changed and commits
    nothing; planned again (no _plan.parquet), the driver names the file before any work."""
    path = tmp_path / "prompts.parquet"
    prompts = [f"a small red circle number {i:02d}" for i in range(20)]  # 4 shards of 5 rows
    pq.write_table(
        pa.table({"prompt": prompts}), path, compression="none", use_dictionary=False, write_statistics=False
    )
    driver, worker = configs(tmp_path, fail={2: -1}, read_rows=True)
    first = run_job(driver, worker, worker_cls=SleepingWorker, stream=io.StringIO(), interactive=False)
    assert first.exit_code == 1 and [f["shard"] for f in first.failed_shards] == [2]
    data = path.read_bytes()
    footer = data[-(8 + int.from_bytes(data[-8:-4], "little")) :]
    assert data.count(b"number 12") == 1
    path.write_bytes(data.replace(b"number 12", b"number 99"))  # row 12: shard 2's
    assert path.stat().st_size == len(data) and path.read_bytes().endswith(footer)

    store = open_store(driver.output_uri)
    _, healthy = configs(tmp_path, read_rows=True)
    log = io.StringIO()
    second = run_job(driver, healthy, worker_cls=SleepingWorker, stream=log, interactive=False)
    assert second.exit_code == 1 and [f["shard"] for f in second.failed_shards] == [2]
    text = log.getvalue()
    assert f"{path}: rows 10..14 (shard 2) changed since the output was planned" in text
    assert "Point the job at a new output, or restore the file" in text
    assert not store.exists(manifest_key(2)), "no image of the edited rows is committed"

    store.delete(PLAN_KEY)  # planned again: the scan's digests are compared with _job.json's
    with pytest.raises(OutputMismatch) as refused:
        run_job(driver, healthy, worker_cls=SleepingWorker, stream=io.StringIO(), interactive=False)
    assert f"input file {path} changed (rows edited in place" in str(refused.value)


def test_a_job_over_caption_and_key_columns(tmp_path):
    """input.prompt_column / input.id_column: the manifests' id and prompt hold those columns,
    every other column passes through."""
    keys = [f"img-{i:03d}" for i in range(12)]
    captions = [f"a small blue square number {i}" for i in range(12)]
    pq.write_table(
        pa.table({"key": keys, "caption": captions, "url": [f"https://x/{k}.jpg" for k in keys]}),
        tmp_path / "prompts.parquet",
    )
    rows = RowConfig(prompt_column="caption", id_column="key")
    driver, _ = configs(tmp_path)
    driver = dataclasses.replace(driver, plan=PlanConfig(rows=rows, shard_size=5))
    _, worker = configs(tmp_path, rows=rows, read_rows=True)
    summary = run_job(driver, worker, worker_cls=SleepingWorker, stream=io.StringIO(), interactive=False)
    assert summary.exit_code == 0 and summary.rows["ok"] == 12
    table = read_manifests(open_store(driver.output_uri)).sort_by("id")
    assert table.column("id").to_pylist() == keys and table.column("prompt").to_pylist() == captions


def test_bad_input_fails_before_anything_is_written(tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", ""], "steps": [4, -1]}), tmp_path / "prompts.parquet")
    driver, worker = configs(tmp_path)
    from ditfleet.driver.input.row_errors import InputError

    with pytest.raises(InputError) as err:
        run_job(driver, worker, worker_cls=SleepingWorker, stream=io.StringIO())
    assert "row 1" in str(err.value) and "steps" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_progress_bar_on_a_terminal_and_status_lines_without_one(tmp_path):
    from ditfleet.driver.dispatch import DispatchSnapshot
    from ditfleet.driver.progress import JobProgress
    from ditfleet.workers.contract import ShardResult

    class Shard:
        index = 4

    result = ShardResult(
        4, 0, "committed", rows=5, images_ok=4, images_failed=1, errors={"boom": 1}, generate_s=1.0,
        encode_s=0.1, upload_s=0.1, wall_s=2.0, worker_id="w1",
    )  # fmt: skip
    tty = io.StringIO()
    progress = JobProgress(total_shards=10, total_images=50, stream=tty, interactive=True)
    progress.actor_ready("w1", {"worker_id": "w1", "load_s": 1.5, "warmup_s": {"64x64": 2.0}}, 4.0)
    progress.shard_committed(Shard(), result)
    progress.tick(DispatchSnapshot(3, 2, 5, 0, 1, 0.0))
    progress.close()
    text = tty.getvalue()
    assert "worker w1 ready in 4.0 s, model load 1.5 s, warm-up 2.0 s" in text
    assert "shard 00004: 4 images ok, 1 FAILED in 2.0 s (2.50 img/s) on w1, attempt 0" in text
    assert "\r\x1b[K[" in text and "5/50 images (1 failed)" in text and "shards 1/10" in text
    plain = io.StringIO()
    progress = JobProgress(10, 50, stream=plain, interactive=False, status_every_s=0)
    progress.tick(DispatchSnapshot(3, 2, 5, 0, 1, 0.0))
    assert "\r" not in plain.getvalue() and "progress: [" in plain.getvalue()


def test_fewer_shards_than_actors_is_said_naming_shards_size(tmp_path):
    """4 rows in shards of 5 for 2 actors: one shard, one actor with nothing to run, said once."""
    write_prompts(tmp_path / "prompts.parquet", 4)
    driver, worker = configs(tmp_path)
    log = io.StringIO()
    summary = run_job(driver, worker, worker_cls=SleepingWorker, stream=log, interactive=False)
    assert summary.exit_code == 0
    assert (
        "warning: 1 shard for up to 2 actors: 1 actor has nothing to run (a shard runs on one actor). "
        "shards.size is 5 rows; shards.size: 2 (or less) gives every actor a shard."
    ) in log.getvalue()
