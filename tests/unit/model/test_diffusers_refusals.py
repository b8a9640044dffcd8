"""A checkpoint whose pipeline cannot run through diffusers is refused on the driver, before any
work, naming what to do (model.diffusers_pipeline.index; `ditfleet validate` through the spec)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditfleet.jobs.cli import main
from ditfleet.model.diffusers_pipeline.index import (
    DiffusersPipelineError,
    call_defaults,
    check_runnable,
    read_index,
)
from ditfleet.model.family import model_family

FLUX_COMPONENTS = {
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def _folder(tmp_path: Path, class_name: str, **components: list) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    index = {"_class_name": class_name, "_diffusers_version": "0.42.1", **FLUX_COMPONENTS, **components}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def _job(tmp_path: Path, model: Path) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: {tmp_path / 'out'}}}\nmodel: {{path: {model}}}\n"
    )
    return job


def test_a_text_to_image_pipeline_is_its_own_family(tmp_path):
    root = _folder(tmp_path, "FluxPipeline")
    assert model_family(str(root)).name == "diffusers:FluxPipeline"
    assert "prompt" in check_runnable(read_index(root))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("class_name", "task"),
    [
        ("FluxPipeline", "text-to-image"),
        ("StableDiffusion3Pipeline", "text-to-image"),
        # Their image is optional (they make images from text alone too): text-to-image.
        ("Flux2KleinPipeline", "text-to-image"),
        ("QwenImage21Pipeline", "text-to-image"),
        ("QwenImage21Pipeline", "text-to-image"),
        ("FluxKontextPipeline", "edit"),
        ("StableDiffusion3Img2ImgPipeline", "edit"),
    ],
)
def test_a_pipeline_whose_call_takes_an_image_is_an_edit_family(tmp_path, class_name, task):
    root = _folder(tmp_path, class_name)
    family = model_family(str(root))
    assert family.name == f"diffusers:{class_name}"
    assert family.task({"_class_name": class_name}) == task  # type: ignore[attr-defined]


def test_call_defaults_are_read_from_diffusers_source():
    flux = call_defaults("FluxPipeline")
    assert (flux["num_inference_steps"], flux["guidance_scale"], flux["max_sequence_length"]) == (
        28,
        3.5,
        512,
    )
    assert call_defaults("StableDiffusion3Img2ImgPipeline")["strength"] == 0.6
    assert call_defaults("NoSuchPipeline") == {}


@pytest.mark.parametrize(
    ("class_name", "components", "says"),
    [
        ("NoSuchPipeline", {}, r"has no pipeline class 'NoSuchPipeline'.*Upgrade diffusers"),
        ("DDPMPipeline", {}, r"DDPMPipeline.__call__ takes no \['prompt'.*text-to-image"),
        ("StableDiffusionImg2ImgPipeline", {}, r"takes no \['height', 'width'\].*text-to-image or edit"),
        (
            "StableDiffusion3InpaintPipeline",
            {},
            r"needs \['mask_image'\], an input ditfleet's jobs do not have",
        ),
        ("FluxControlPipeline", {}, r"needs \['control_image'\]"),
        ("WanPipeline", {}, r"makes video"),
        (
            "FluxPipeline",
            {"text_encoder_2": ["no_such_package_x", "Encoder"]},
            r"need \['no_such_package_x'\].*pip install",
        ),
    ],
)
def test_validate_refuses_what_cannot_run(tmp_path, capsys, class_name, components, says):
    root = _folder(tmp_path, class_name, **components)
    with pytest.raises(DiffusersPipelineError, match=says):
        check_runnable(read_index(root))  # type: ignore[arg-type]
    assert main(["validate", str(_job(tmp_path, root))]) == 2
    err = capsys.readouterr().err
    assert "model_index.json" in err, err


def test_vqa_is_refused_for_a_diffusers_pipeline(tmp_path, capsys):
    root = _folder(tmp_path, "FluxPipeline")
    job = _job(tmp_path, root)
    job.write_text(job.read_text() + "quality: {scorers: [vqa]}\n")
    assert main(["validate", str(job)]) == 2
    assert "leave 'vqa' out" in capsys.readouterr().err
