"""An OOM halves the batch and retries it after the failed attempt's tensors are freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.workers.generate import BatchGenerator, image_requests, plan_batches
from ditfleet.workers.rows import PromptRow


def _rows(n: int) -> list[PromptRow]:
    return [
        PromptRow(
            id=f"r{i}",
            prompt=f"a small red circle number {i}",
            negative_prompt=" ",
            seed=100 + i,
            width=32,
            height=32,
            requested_width=None,
            requested_height=None,
            bucket="32x32",
            steps=1,
            true_cfg_scale=2.0,
            num_images=1,
            file="prompts.parquet",
            row=i,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def pipe(random_model_dir):
    return load_pipeline(random_model_dir, max_sequence_length=64)


@pytest.mark.slow
def test_the_failed_batch_is_freed_before_the_retry_and_images_match(pipe):
    requests = image_requests(_rows(4))
    real_run = pipe.run
    failed_tensors: list[weakref.ref] = []
    alive_at_retry: list[int] = []

    def run_that_runs_out_of_memory(inputs, sampling):
        if len(sampling.seeds) > 1:
            activations = torch.empty(8 * 1024 * 1024)  # what a real attempt holds when it fails
            failed_tensors.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        alive_at_retry.append(sum(ref() is not None for ref in failed_tensors))
        return real_run(inputs, sampling)

    expected = BatchGenerator(pipe).run(requests[:1]) + BatchGenerator(pipe).run(requests[1:2])
    gc.disable()  # refcounting alone must free them: no reliance on a collection
    try:
        pipe.run = run_that_runs_out_of_memory
        generator = BatchGenerator(pipe)
        (batch,) = plan_batches(requests, 4)
        images = generator.run(batch)
    finally:
        gc.enable()
        del pipe.run
    assert generator.oom_splits == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert [img.request for img in images] == requests, "input order is kept"
    assert len(failed_tensors) == 3 and alive_at_retry == [0, 0, 0, 0]
    for got, want in zip(images[:2], expected):
        assert torch.equal(got.pixels, want.pixels)


def test_a_single_image_oom_or_another_error_is_raised(pipe):
    requests = image_requests(_rows(2))

    def broken(inputs, sampling):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    pipe.run = broken
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            BatchGenerator(pipe).run(requests)
    finally:
        del pipe.run


@pytest.mark.slow
def test_the_shard_result_reports_oom_splits(random_model_dir, tmp_path):
    """A split changes pixels at rounding level, so the shard result says how many there were."""
    from ditfleet.workers.actor import GenerationWorker
    from tests.support.worker_fixtures import shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 4, sizes=False)
    worker = GenerationWorker(worker_config(random_model_dir, str(tmp_path / "out"), batch_size=4))
    real_run = worker.pipe.run
    failed_calls = []

    def run_that_runs_out_of_memory(inputs, sampling):
        if len(sampling.seeds) > 1:
            failed_calls.append(len(sampling.seeds))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_run(inputs, sampling)

    worker.pipe.run = run_that_runs_out_of_memory
    result = worker.run_shard(shard_of(prompts, 0, 0, 4), attempt=0)
    assert result.status == "committed" and result.images_ok == 4
    assert failed_calls == [4, 2, 2]  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert result.oom_splits == 3
    del worker.pipe.run
    again = worker.run_shard(shard_of(prompts, 1, 0, 4), attempt=0)
    assert again.oom_splits == 0  # counted per shard, not per actor


def test_the_progress_log_and_the_job_summary_show_oom_splits():
    import io

    from ditfleet.driver.output.status import OutputCounts
    from ditfleet.driver.output.summary import RunOutcome, build_summary
    from ditfleet.driver.progress import JobProgress
    from ditfleet.workers.contract import ShardResult
    from ditfleet.workers.rows import ShardSpec

    stream = io.StringIO()
    progress = JobProgress(total_shards=2, total_images=8, stream=stream, interactive=False)
    for index, splits in ((0, 3), (1, 0)):
        shard = ShardSpec(index, "in.parquet", 0, 4, 0, ("32x32",), 4)
        result = ShardResult(index, 0, "committed", rows=4, images_ok=4, wall_s=1.0, worker_id="w1")
        result.oom_splits = splits
        progress.shard_committed(shard, result)
    assert "shard 00000: 4 images ok, 3 OOM splits in 1.0 s" in stream.getvalue()
    assert "shard 00001: 4 images ok in 1.0 s" in stream.getvalue()
    planned = {"shards": 2, "rows": 8, "images": 8}
    timings = {"wall_s": 2.0, "plan_s": 0.1, "dispatch_s": 1.9}
    run = RunOutcome((), frozenset(), "f", planned, None, progress, timings)
    summary = build_summary("out", run, OutputCounts(shards=2, rows_ok=8, images_ok=8))
    assert summary.oom_splits == 3 and summary.workers["w1"]["oom_splits"] == 3
    assert "WARNING: 3 OOM splits: batches halved after CUDA out of memory" in summary.format_text()
