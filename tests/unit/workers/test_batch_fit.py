"""A mixed fleet: each actor runs the largest batch its own GPU fits, at most workers.batch_size,
from the same memory plan `ditfleet plan` shows (device memory faked: no GPU, no Ray)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from ditfleet.driver.memory_plan import job_memory_plan
from ditfleet.jobs.spec import load_spec
from ditfleet.model.memory import GB
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.workers import batch_fit
from ditfleet.workers.batch_fit import BatchFit, BatchFitError, fit_batch_size
from tests.support.paths import REPO

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """Qwen-Image's published configs only: the plan never reads a weight."""
    root = tmp_path_factory.mktemp("fit") / "qwen-image"
    for part in ("transformer", "vae", "text_encoder", "scheduler"):
        shutil.copytree(PUBLISHED / "qwen-image" / part, root / part)
    return root


def _spec(
    tmp_path: Path, model: Path, batch_size: int, quantization: str = "fp8", te: str = "gpu", more: str = ""
):
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input: {{path: {REPO / 'jobs' / 'examples' / 'prompts.parquet'}}}\n"
        f"output: {{uri: {tmp_path / 'out'}}}\n"
        f"model: {{path: {model}, text_encoder: {te}, quantization: {quantization}{more}}}\n"
        "buckets: {names: [1328x1328, 1024x1024]}\n"
        f"workers: {{batch_size: {batch_size}}}\n"
    )
    return load_spec(job)


def _gpu(monkeypatch, gb: float, name: str = "NVIDIA test GPU") -> None:
    monkeypatch.setattr(batch_fit, "device_memory", lambda device: (name, int(gb * GB)))


@pytest.mark.parametrize(
    ("more", "batches"),
    [
        # the defaults: FP8 layer set 'safe' (2.3 GB more weights), the modulation table on a GPU
        ("", (38, 6)),
        # every layer in FP8, the per-step modulation cache: the batches before both defaults
        (", fp8_layers: all, modulation_cache: cfg", (40, 9)),
    ],
)
def test_each_gpu_size_takes_its_own_largest_batch_the_plan_shows(
    tmp_path, qwen_dir, monkeypatch, more, batches
):
    spec = _spec(tmp_path, qwen_dir, batch_size=64, more=more)
    config = spec.to_worker_config()
    by_gpu = job_memory_plan(spec.memory_request()).largest_by_gpu()
    fits = {}
    for gb in (80, 48):
        _gpu(monkeypatch, gb)
        fits[gb] = fit_batch_size(config, qwen_dir, CUDA, torch.bfloat16)
        # The actor's batch is the plan's: the smallest bucket's largest batch on that GPU.
        assert fits[gb].batch_size == min(by_gpu[b][f"{gb}"]["gpu"] for b in by_gpu)
        assert fits[gb].limited_by == "1328x1328" and fits[gb].job_batch_size == 64
    assert (fits[80].batch_size, fits[48].batch_size) == batches  # FP8 DiT, text encoder on the GPU
    assert fits[48].to_dict()["largest"]["1024x1024"] > 6


def test_never_above_the_jobs_batch_size_and_unchanged_on_the_cpu(tmp_path, qwen_dir, monkeypatch):
    config = _spec(tmp_path, qwen_dir, batch_size=8).to_worker_config()
    _gpu(monkeypatch, 80)
    fit = fit_batch_size(config, qwen_dir, CUDA, torch.bfloat16)
    assert fit.batch_size == 8 and fit.limited_by is None
    monkeypatch.setattr(batch_fit, "device_memory", lambda device: pytest.fail("no GPU to read on the CPU"))
    assert fit_batch_size(config, qwen_dir, torch.device("cpu"), torch.float32).batch_size == 8


def test_a_gpu_that_fits_no_image_is_refused_at_start_up_saying_what_would(tmp_path, qwen_dir, monkeypatch):
    config = _spec(tmp_path, qwen_dir, batch_size=4, quantization="none").to_worker_config()
    _gpu(monkeypatch, 48, "NVIDIA L40S")
    with pytest.raises(BatchFitError, match=r"NVIDIA L40S, 48.0 GB.*bucket 1328x1328.*quantization: fp8"):
        fit_batch_size(config, qwen_dir, CUDA, torch.bfloat16)
    # The same GPU with the text encoder off it fits bf16 (the plan says 5 at 1328x1328).
    config = _spec(tmp_path, qwen_dir, batch_size=16, quantization="none", te="cpu").to_worker_config()
    assert fit_batch_size(config, qwen_dir, CUDA, torch.bfloat16).batch_size == 5


@pytest.mark.slow
def test_the_actor_runs_and_reports_the_batch_it_fitted(tmp_path, monkeypatch):
    """The worker path on the CPU: the fitted batch plans the batches and is reported in the
    start-up report, the ShardResult and every manifest row."""
    from ditfleet.workers import actor
    from ditfleet.workers.output.manifest import read_manifests
    from ditfleet.workers.storage import open_store
    from tests.support.worker_fixtures import shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 6, sizes=False, extra=False)
    config = worker_config("tiny", str(tmp_path / "out"), batch_size=4)
    worker = actor.GenerationWorker(config)
    assert worker.startup_report()["batch_size"] == 4  # on the CPU: the job's
    # As on a GPU that fits 2 of the job's 4: batches of at most 2.
    fitted = BatchFit(2, 4, 48.0, limited_by="64x64", largest={"64x64": 2})
    monkeypatch.setattr(actor, "fit_batch_size", lambda *a: fitted)
    worker = actor.GenerationWorker(dataclasses.replace(config, output_uri=str(tmp_path / "out2")))
    planned: list[list] = []

    def plan_batches(requests, batch_size, count_tokens=None, **kwargs):
        planned.extend(real_plan(requests, batch_size, count_tokens, **kwargs))
        return planned

    from ditfleet.workers import quality_gate  # where the actor's batches are planned

    real_plan = quality_gate.plan_batches
    monkeypatch.setattr(quality_gate, "plan_batches", plan_batches)
    result = worker.run_shard(shard_of(prompts, 0, 0, 6))
    assert result.status == "committed" and result.batch_size == 2
    assert max(len(b) for b in planned) == 2 and sum(len(b) for b in planned) == 6
    report = worker.startup_report()
    assert report["batch_size"] == 2 and report["batch_fit"]["job_batch_size"] == 4
    table = read_manifests(open_store(str(tmp_path / "out2")))
    assert set(table.column("batch_size").to_pylist()) == {2}


def test_a_job_without_cfg_is_sized_for_one_branch_the_plan_and_the_actor_agree(
    tmp_path, qwen_dir, monkeypatch
):
    """Issue 50, lever 3: a job without CFG (a few-step checkpoint's) is sized for its one DiT
    branch, so where a branch holds memory of its own (a step cache's kept tensors) a 48 GB GPU
    batches more of it than of a CFG job; the driver's plan and the actor say the same."""
    fits = {}
    for scale in (4.0, 1.0):
        spec = _spec(tmp_path, qwen_dir, batch_size=64, quantization="none", te="cpu")
        job = tmp_path / "job.yaml"
        job.write_text(job.read_text() + f"sampling: {{true_cfg_scale: {scale}, step_cache: fast}}\n")
        spec = load_spec(job)
        by_gpu = job_memory_plan(spec.memory_request()).largest_by_gpu()
        _gpu(monkeypatch, 48)
        fit = fit_batch_size(spec.to_worker_config(), qwen_dir, CUDA, torch.bfloat16)
        assert fit.batch_size == min(by_gpu[b]["48"]["cpu"] for b in by_gpu)
        fits[scale] = fit.batch_size
    assert fits[1.0] >= 4 and fits[1.0] > fits[4.0], fits
