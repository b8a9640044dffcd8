"""An edit job's plan counts its rows' sources (driver/plan.py -> driver/memory_plan.py): per bucket
the heaviest row's sources, as their headers say, in the DiT's tokens, the `source_encode` phase
and Qwen2.5-VL's vision tokens in the prompt; `ditfleet plan` shows them and refuses a batch that
fits the text job but not the edit, and so does `ditfleet run` once planned; an actor's batch fit
counts them too. Published-width configs, no weights, no Ray (device memory faked)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.memory_plan import MemoryPlanError, MemoryRequest, job_memory_plan
from ditfleet.driver.plan import PlanConfig, heavier, plan_job
from ditfleet.driver.plan_file import plan_from_table, plan_table
from ditfleet.jobs.cli import main
from ditfleet.jobs.run import run
from ditfleet.jobs.spec import load_spec
from ditfleet.model.family import model_family, source_prompt_tokens
from ditfleet.model.memory import GB
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.workers import batch_fit
from ditfleet.workers.batch_fit import fit_batch_size
from ditfleet.workers.rows import RowConfig

BUCKET = "1328x1328"  # where a square source's row goes without a size (the family's nearest)
GPU_GB = 48


def _edit_model(folder: Path) -> Path:
    """Qwen-Image-Edit-2509's configs (the Qwen-Image DiT, VAE and Qwen2.5-VL as published) and its
    model_index.json: what the plan reads."""
    shutil.copytree(PUBLISHED / "qwen-image", folder)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    return folder


def _sources(folder: Path, sizes: dict[str, tuple[int, int]]) -> None:
    folder.mkdir(exist_ok=True)
    for name, size in sizes.items():
        Image.new("RGB", size, (90, 140, 200)).save(folder / name)


def _edit_input(tmp_path: Path, images: list[list[str]]) -> Path:
    path = tmp_path / "edits.parquet"
    prompts = [f"make the shape blue {i}" for i in range(len(images))]
    pq.write_table(pa.table({"prompt": prompts, "image": images}), path)
    return path


def _job(tmp_path: Path, model: Path, batch: int) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input:\n  path: {tmp_path / 'edits.parquet'}\n  image_column: image\n"
        f"output:\n  uri: {tmp_path / 'out'}\nmodel:\n  path: {model}\n  text_encoder: cpu\n"
        f"workers:\n  batch_size: {batch}\n  gpu_memory_gb: {GPU_GB}\n"
    )
    return job


def test_the_plan_keeps_each_buckets_heaviest_rows_sources(tmp_path):
    _sources(tmp_path, {"small.png": (512, 512), "big.png": (1024, 1024), "wide.png": (1600, 900)})
    path = _edit_input(tmp_path, [["small.png"], ["big.png", "small.png"], ["big.png"], ["wide.png"]])
    config = PlanConfig(rows=RowConfig(image_column="image"), shard_size=2)
    plan = plan_job(PromptSource(str(path)), config)
    # the square rows share a bucket: the two-source row is its heaviest; the wide row has its own
    assert plan.sources_per_bucket[BUCKET] == ((1024, 1024), (512, 512))
    (wide,) = (b for b in plan.sources_per_bucket if b != BUCKET)
    assert plan.sources_per_bucket[wide] == ((1600, 900),)
    # the sources are not part of the fingerprint (their identities are, in the content digest)
    assert "sources" not in json.dumps(plan.fingerprint_doc())
    # heavier: more pixels at the VAE's encode size, then more sources
    assert heavier(((4000, 3000),), ((1024, 1024),)) == ((4000, 3000),)  # 4:3 at 1024x1024's area: more
    assert heavier(((512, 512),), ((512, 512), (512, 512))) == ((512, 512), (512, 512))


def test_each_source_adds_its_vision_tokens_to_the_prompt_length(tmp_path):
    model = _edit_model(tmp_path / "edit-model")
    two = ((1024, 1024), (1024, 1024))
    # 2509 shows Qwen2.5-VL each source at 384x384: 14 x 14 merged patches, 2 markers, "Picture i: "
    assert source_prompt_tokens(str(model), two[:1]) == 196 + 2 + 5
    assert source_prompt_tokens(str(model), two) == 2 * 203
    assert source_prompt_tokens("tiny", two) == 0  # a text-to-image model sees no images
    request = MemoryRequest(str(model), (BUCKET,), 1, bucket_sources={BUCKET: two})
    assert request.text_len_for(()) == 512 and request.text_len_for(two) == 1024  # 512 + 406, bucketed
    # past the largest prompt-length bucket, as long as it is (an edit prompt is not cut)
    assert request.text_len_for(two * 2) == 512 + 4 * 203
    plan = job_memory_plan(request)
    assert plan is not None and plan.plans[0].text_len == 1024 and plan.plans[0].sources == two


def test_plan_refuses_a_batch_that_fits_the_text_job_but_not_two_sources(tmp_path, capsys):
    model = _edit_model(tmp_path / "edit-model")
    _sources(tmp_path, {"a.png": (1024, 1024), "b.png": (1024, 1024)})
    _edit_input(tmp_path, [["a.png", "b.png"]] * 3)
    # the text job's largest batch at this bucket on this GPU, and the edit's: the plan's numbers
    text = job_memory_plan(MemoryRequest(str(model), (BUCKET,), 1, text_encoder="cpu", gpu_memory_gb=GPU_GB))
    edit = job_memory_plan(
        MemoryRequest(
            str(model), (BUCKET,), 1, text_encoder="cpu", gpu_memory_gb=GPU_GB,
            bucket_sources={BUCKET: ((1024, 1024),) * 2},
        )
    )  # fmt: skip
    assert text is not None and edit is not None
    fits_text, fits_edit = text.largest[BUCKET], edit.largest[BUCKET]
    assert fits_text > fits_edit >= 1, (fits_text, fits_edit)

    assert main(["plan", str(_job(tmp_path, model, fits_text))]) != 0
    out = capsys.readouterr()
    assert f"sources: {BUCKET}: up to 2 sources a row (1024x1024, 1024x1024: its heaviest row)" in out.out
    assert f"{BUCKET} x{fits_text} with 2 sources each bf16, text encoder cpu" in out.out
    assert f"bucket {BUCKET}: workers.batch_size {fits_text} needs " in out.err
    assert f"at its denoise peak; the largest batch that fits {GPU_GB} GB is {fits_edit}" in out.err

    assert main(["plan", str(_job(tmp_path, model, fits_edit)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sources_per_bucket"] == {BUCKET: ["1024x1024", "1024x1024"]}
    # every bucket of the job is planned; those no row goes to, with one square source
    # (workers.sources.planned_sources, what is planned before the sources are read)
    by_name = {b["bucket"]: b for b in doc["memory"]["buckets"]}
    bucket = by_name.pop(BUCKET)
    assert all(b["sources"] == ["1024x1024"] for b in by_name.values())
    assert bucket["sources"] == ["1024x1024", "1024x1024"] and "source_encode" in bucket["phases_gb"]
    assert doc["memory"]["largest_batch"][BUCKET] == fits_edit


@pytest.mark.parametrize("sources", [(), ((1024, 1024),)])
def test_a_text_request_and_a_bucket_without_sources_plan_as_before(tmp_path, sources):
    model = _edit_model(tmp_path / "edit-model")
    base = MemoryRequest(str(model), (BUCKET, "1024x1024"), 1, text_encoder="cpu")
    with_other = MemoryRequest(
        str(model), (BUCKET, "1024x1024"), 1, text_encoder="cpu", bucket_sources={"1024x1024": sources}
    )
    a, b = job_memory_plan(base), job_memory_plan(with_other)
    assert a is not None and b is not None
    assert a.plans[0] == b.plans[0]  # the bucket the sources are not of
    assert (a.plans[1] == b.plans[1]) is (not sources)


def test_run_refuses_the_edit_batch_after_planning_before_any_write(tmp_path):
    model = _edit_model(tmp_path / "edit-model")
    _sources(tmp_path, {"a.png": (1024, 1024), "b.png": (1024, 1024)})
    _edit_input(tmp_path, [["a.png", "b.png"]] * 3)
    # before planning, an edit job is checked with one square source a row: this batch passes
    one = MemoryRequest(
        str(model), (BUCKET,), 1, text_encoder="cpu", gpu_memory_gb=GPU_GB, sources=((1024, 1024),)
    )
    before = job_memory_plan(one)
    assert before is not None
    job = _job(tmp_path, model, before.largest[BUCKET])
    with pytest.raises(MemoryPlanError, match=f"bucket {BUCKET}: workers.batch_size .* at its denoise peak"):
        run(str(job))
    assert not (tmp_path / "out").exists()  # refused before the output was claimed


def test_an_actors_batch_fit_counts_its_buckets_sources(tmp_path, monkeypatch):
    model = _edit_model(tmp_path / "edit-model")
    _sources(tmp_path, {"a.png": (1024, 1024), "b.png": (1024, 1024)})
    _edit_input(tmp_path, [["a.png", "b.png"]] * 3)
    spec = load_spec(_job(tmp_path, model, 64))
    two = {BUCKET: ((1024, 1024),) * 2}
    config = dataclasses.replace(spec.to_worker_config(), warmup_buckets=(BUCKET,))
    monkeypatch.setattr(batch_fit, "device_memory", lambda device: ("NVIDIA test GPU", int(GPU_GB * GB)))
    cuda = torch.device("cuda", 0)
    text = fit_batch_size(config, model, cuda, torch.bfloat16)
    edit = fit_batch_size(dataclasses.replace(config, bucket_sources=two), model, cuda, torch.bfloat16)
    planned = job_memory_plan(spec.memory_request(two))
    assert planned is not None
    # the actor's batch is the plan's, with the sources; without them it would take the text job's
    assert edit.batch_size == planned.largest_by_gpu()[BUCKET][f"{GPU_GB:g}"]["cpu"] < text.batch_size


def test_a_stored_plan_keeps_its_sources(tmp_path):
    _sources(tmp_path, {"a.png": (1024, 1024), "b.png": (800, 600)})
    path = _edit_input(tmp_path, [["a.png", "b.png"], ["a.png"]])
    config = PlanConfig(rows=RowConfig(image_column="image"))
    plan = plan_job(PromptSource(str(path)), config)
    assert plan_from_table(plan_table(plan), config).sources_per_bucket == plan.sources_per_bucket != {}


def test_plan_selftest_prices_the_edit_with_its_sources(tmp_path, capsys):
    model = _edit_model(tmp_path / "edit-model")
    _sources(tmp_path, {"a.png": (1024, 1024), "b.png": (1024, 1024)})
    _edit_input(tmp_path, [["a.png", "b.png"]] * 3)
    selftest = tmp_path / "selftest.jsonl"
    lines = [  # a self-test's speed lines (numbers made up)
        {"stage": "env", "status": "pass", "device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3"},
        {"stage": "cfg_step", "status": "measured", "size": "1328x1328", "text_len": 64,
         "ms_per_cfg_step": {"off": 260.0, "cfg": 250.0, "table": 245.0}},
        {"stage": "vae_decode", "status": "measured", "size": "1328x1328", "eager_ms": 90.0, "compiled_ms": 60.0},
    ]  # fmt: skip
    selftest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = _job(tmp_path, model, 1)
    assert main(["plan", str(job), "--selftest", str(selftest), "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["sources"] == ["1024x1024", "1024x1024"]  # the heaviest row's
    config = json.loads((model / "transformer" / "config.json").read_text())
    family = model_family(str(model))
    factor = family.forward_flops(config, 1328, 1328, 64, ((1024, 1024),) * 2) / family.forward_flops(
        config, 1328, 1328, 64
    )
    assert cost["by_bucket"][BUCKET]["edit_step_factor"] == pytest.approx(factor) and factor > 1.5
    assert main(["plan", str(job), "--selftest", str(selftest)]) == 0
    assert "2 sources a row" in capsys.readouterr().out
