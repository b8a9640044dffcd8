"""Qwen-Image-Edit in the Qwen-Image family against diffusers' own edit pipelines, on a random
toy checkpoint built here (ditfleet.testing.models.write_toy_edit_checkpoint) with a toy
Qwen2.5-VL that sees the sources: the same inputs and seeds give the same images, fp32 on the CPU,
within 1e-4. The sources are resized to smaller areas than the published 1024 x 1024 (VAE) and
384 x 384 (vision) on both sides, so the test runs in seconds; the maths is the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("diffusers")

from ditfleet.model.family import load_pipeline, model_task  # noqa: E402
from ditfleet.testing.models import write_toy_edit_checkpoint  # noqa: E402
from ditfleet.testing.qwen_vl import reference_processor  # noqa: E402

VAE_AREA = 192 * 192
VISION_AREA = 64 * 64
STEPS = 3


def _image(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    levels = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(levels.flatten().tolist()))


def _reference(root, pipeline_class: str, monkeypatch):
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    module = getattr(diffusers.pipelines.qwenimage, _MODULES[pipeline_class])
    if hasattr(module, "VAE_IMAGE_SIZE"):
        monkeypatch.setattr(module, "VAE_IMAGE_SIZE", VAE_AREA)
        monkeypatch.setattr(module, "CONDITION_IMAGE_SIZE", VISION_AREA)
    return getattr(diffusers, pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(root / "vae").eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        processor=reference_processor(root),
        transformer=QwenImageTransformer2DModel.from_pretrained(root / "transformer").eval(),
    )


_MODULES = {
    "QwenImageEditPlusPipeline": "pipeline_qwenimage_edit_plus",
    "QwenImageEditPipeline": "pipeline_qwenimage_edit",
}


def _ours(root, vae_area: int = VAE_AREA):
    pipe = load_pipeline(root, "cpu", torch.float32)
    assert pipe.edit is not None
    # The smaller areas of the reference (model.qwen_image.edit.EditStyle's test knob).
    vision = None if pipe.edit.vision_area is None else VISION_AREA
    pipe.edit = dataclasses.replace(pipe.edit, vae_area=vae_area, vision_area=vision)
    return pipe


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    return write_toy_edit_checkpoint(tmp_path_factory.mktemp("edit") / "plus", text_encoder="qwen-vl")


@pytest.mark.parametrize("sizes", [[(96, 64)], [(80, 80), (64, 112)]], ids=["one source", "two sources"])
def test_edit_plus_matches_diffusers(plus_dir, monkeypatch, sizes):
    assert model_task(plus_dir) == "edit"
    sources = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    prompt, negative, seed = "make the shape blue", " ", 7
    ref = _reference(plus_dir, "QwenImageEditPlusPipeline", monkeypatch)
    expected = ref(
        image=sources,
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=4.0,
        height=96,
        width=128,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).images
    ours = _ours(plus_dir).generate(
        [prompt], negative, sources=[sources], height=96, width=128, steps=STEPS, seeds=[seed]
    )
    assert ours.shape == expected.shape == (1, 3, 96, 128)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
