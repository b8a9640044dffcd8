"""Issue 51: a row with more source images than its model takes is refused before any work.

The first Qwen-Image-Edit (QwenImageEditPipeline) and diffusers' single-image pipelines (SD3
image-to-image, FLUX Kontext) take one source per row; a row with two reached the pipeline,
which raised, so its shard failed on every attempt (and the job with it). `ditfleet validate`
and `plan` now name the file, row and column (exit 2, nothing written); the pipelines' own checks
stay as the last guard. Edit Plus (2509, 2511) takes several. Toy checkpoints are built here."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from ditfleet.jobs.cli import main  # noqa: E402
from ditfleet.jobs.spec import parse_spec  # noqa: E402
from ditfleet.model.diffusers_pipeline.index import pipeline_max_sources  # noqa: E402
from ditfleet.model.family import load_pipeline, model_family, model_max_sources  # noqa: E402
from ditfleet.testing.diffusers_models import make_sd3_dir  # noqa: E402
from ditfleet.testing.models import write_toy_edit_checkpoint  # noqa: E402

TWO_SOURCES = "2 source images; the model (model.path) takes at most 1 per row"


def _job(tmp_path: Path, model: Path, images: list[list[str]]) -> Path:
    """An edit job over a list<string> image column (a row per entry of `images`), its sources
    real PNGs beside the input file."""
    for name in {n for row in images for n in row}:
        Image.new("RGB", (48, 32), (200, 40, 40)).save(tmp_path / name)
    prompts = [f"make shape {i} blue" for i in range(len(images))]
    pq.write_table(
        pa.table({"prompt": prompts, "image": pa.array(images, pa.list_(pa.string()))}),
        tmp_path / "p.parquet",
    )
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input:\n  path: {tmp_path / 'p.parquet'}\n  image_column: image\n"
        f"output:\n  uri: {tmp_path / 'out'}\nmodel:\n  path: {model}\n"
    )
    return job


def test_the_first_qwen_image_edit_refuses_a_row_of_two_sources_before_any_work(tmp_path, capsys):
    model = write_toy_edit_checkpoint(tmp_path / "edit", pipeline_class="QwenImageEditPipeline")
    assert model_family(str(model)).max_sources({"_class_name": "QwenImageEditPipeline"}) == 1
    assert model_max_sources(model) == 1
    job = _job(tmp_path, model, [["a.png"], ["a.png", "b.png"], [], ["b.png"]])
    assert parse_spec(job.read_text()).row_config().max_sources == 1
    for command in ("validate", "plan"):
        assert main([command, str(job)]) == 2, command
        err = capsys.readouterr().err
        where = f"{tmp_path / 'p.parquet'}: row"
        assert f"{where} 1, column 'image': {TWO_SOURCES}" in err, err
        assert "point model.path at a model that takes several" in err
        assert f"{where} 2, column 'image': no source image (an empty list)" in err
        assert f"{where} 0," not in err and f"{where} 3," not in err  # one source each: fine
        assert not (tmp_path / "out").exists()  # refused before anything is written
    # The last guard: the pipeline itself refuses the row (a model not read on the driver, s3://).
    pipe = load_pipeline(model, "cpu", torch.float32)
    two = [[Image.new("RGB", (32, 32)), Image.new("RGB", (32, 32))]]
    with pytest.raises(
        ValueError, match=r"sources\[0\]: 2 source images; QwenImageEditPipeline takes at most 1"
    ):
        pipe.encode_guidance(["make it blue"], None, 1.0, 64, sources=two)


def test_edit_plus_takes_two_sources_per_row(tmp_path):
    model = write_toy_edit_checkpoint(tmp_path / "edit-plus")
    assert model_max_sources(model) is None
    job = _job(tmp_path, model, [["a.png"], ["a.png", "b.png"], ["b.png", "a.png", "b.png"]])
    assert parse_spec(job.read_text()).row_config().max_sources is None
    assert main(["validate", str(job)]) == 0


def test_a_diffusers_single_image_pipeline_refuses_a_row_of_two_sources(tmp_path, capsys):
    model = make_sd3_dir(tmp_path / "sd3-img2img", img2img=True)
    assert model_max_sources(model) == 1
    job = _job(tmp_path, model, [["a.png"], ["b.png", "a.png"]])
    assert main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'p.parquet'}: row 1, column 'image': {TWO_SOURCES}" in err, err
    # The last guard on the actor: the loaded pipeline refuses the row too.
    pipe = model_family(str(model)).load_pipeline(
        model, device="cpu", dtype=torch.float32, model_revision="r"
    )
    two = [[Image.new("RGB", (32, 32)), Image.new("RGB", (32, 32))]]
    with pytest.raises(ValueError, match=r"StableDiffusion3Img2ImgPipeline takes at most 1 per prompt"):
        pipe.encode_guidance(["make it blue"], [""], 5.0, 256, sources=two)


def test_the_limit_is_read_from_each_pipelines_call_signature():
    """diffusers' image-batch types (PipelineImageInput, tensors) take one image per prompt; a
    list of PIL images is one prompt's references (FLUX.2); no `image` at all: text-to-image."""
    assert pipeline_max_sources("StableDiffusion3Img2ImgPipeline") == 1
    assert pipeline_max_sources("FluxKontextPipeline") == 1
    assert pipeline_max_sources("Flux2Pipeline") is None
    assert pipeline_max_sources("FluxPipeline") == 0
