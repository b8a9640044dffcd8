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
    else:  # the first edit pipeline names 1024 * 1024 in its __call__
        dimensions = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda _area, ratio: dimensions(VAE_AREA, ratio))
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
def checkpoints(tmp_path_factory):
    """(pipeline class, zero_cond_t) -> a toy edit checkpoint with a toy Qwen2.5-VL, built once."""
    made: dict = {}

    def get(pipeline_class: str = "QwenImageEditPlusPipeline", zero_cond_t: bool = False):
        key = (pipeline_class, zero_cond_t)
        if key not in made:
            out = tmp_path_factory.mktemp("edit") / f"{pipeline_class}-{zero_cond_t}"
            made[key] = write_toy_edit_checkpoint(
                out, text_encoder="qwen-vl", pipeline_class=pipeline_class, zero_cond_t=zero_cond_t
            )
        return made[key]

    return get


@pytest.mark.parametrize(
    "variant, sizes",
    [
        ("2509", [(96, 64)]),
        ("2509", [(80, 80), (64, 112)]),
        ("2511", [(96, 64)]),
        ("2511", [(80, 80), (64, 112)]),
        ("first", [(112, 64)]),
    ],
    ids=["2509 one source", "2509 two sources", "2511 one source", "2511 two sources", "first edit model"],
)
def test_edit_matches_diffusers(checkpoints, monkeypatch, variant, sizes):
    """2509 and 2511 (QwenImageEditPlusPipeline; 2511's transformer has zero_cond_t) and the
    first Qwen-Image-Edit (QwenImageEditPipeline, one source)."""
    pipeline_class = "QwenImageEditPipeline" if variant == "first" else "QwenImageEditPlusPipeline"
    root = checkpoints(pipeline_class, zero_cond_t=variant == "2511")
    assert model_task(root) == "edit"
    sources = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    prompt, negative, seed = "make the shape blue", " ", 7
    ref = _reference(root, pipeline_class, monkeypatch)
    expected = ref(
        image=sources if variant != "first" else sources[0],
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=4.0,
        height=96,
        width=128,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
    ).images
    ours = _ours(root).generate(
        [prompt], negative, sources=[sources], height=96, width=128, steps=STEPS, seeds=[seed]
    )
    assert ours.shape == expected.shape == (1, 3, 96, 128)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def _dit(zero_cond_t: bool):
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

    config = TransformerConfig(
        num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6), zero_cond_t=zero_cond_t,
    )  # fmt: skip
    torch.manual_seed(0)
    return QwenImageTransformer(config, modulation_cache="off").eval()


def test_sources_are_attended_to_and_zero_cond_t_modulates_them_at_t0():
    """The DiT predicts the target's tokens only; the sources change that prediction, and 2511's
    zero_cond_t changes it again (the sources modulated at t = 0), while a forward without sources
    is the same with or without zero_cond_t."""
    from ditfleet.model.qwen_image.transformer import prepare_inputs

    plain, zero = _dit(False), _dit(True)
    zero.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    latents, embeds = torch.randn(2, 12, 64, generator=g), torch.randn(2, 5, 16, generator=g)
    t = torch.tensor([0.6])
    source = torch.randn(2, 6, 64, generator=g)

    def forward(model, sources=None, grids=()):
        inputs = prepare_inputs(latents, embeds, None, t, (3, 4), source_latents=sources, source_grids=grids)
        with torch.no_grad():
            return model(**inputs)

    text_only = [forward(m) for m in (plain, zero)]
    edit = [forward(m, source, ((2, 3),)) for m in (plain, zero)]
    other = forward(plain, source.flip(1), ((2, 3),))
    assert edit[0].shape == (2, 12, 64)
    torch.testing.assert_close(text_only[0], text_only[1], atol=0, rtol=0)
    assert (edit[0] - text_only[0]).abs().max() > 1e-3
    assert (edit[1] - edit[0]).abs().max() > 1e-3
    assert (other - edit[0]).abs().max() > 1e-3


def test_a_model_is_given_sources_only_when_it_edits(tmp_path):
    from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir

    edit = load_pipeline(write_toy_edit_checkpoint(tmp_path / "edit"), "cpu")
    text = load_pipeline(add_tiny_text_encoder(make_diffusers_model_dir(tmp_path / "t2i")), "cpu")
    assert model_task(tmp_path / "t2i") == "text-to-image" and text.edit is None
    source = _image(64, 48, seed=0)
    with pytest.raises(ValueError, match="an edit model needs source images"):
        edit.encode_guidance(["a red circle"])
    with pytest.raises(ValueError, match="a text-to-image model takes no source images"):
        text.encode_guidance(["a red circle"], sources=[[source]])
    with pytest.raises(
        ValueError, match=r"row 1 has source grids \[\(64, 64\)\] but row 0 has \[\(56, 74\)\]"
    ):
        edit.encode_guidance(["a", "b"], sources=[[source], [_image(64, 64, seed=1)]])
    # The tiny text encoder cannot see images: the sources reach the DiT as latent tokens only;
    # 64 x 48 at the 1024 x 1024 area is 1184 x 896 (multiples of 32), 74 x 56 tokens.
    inputs = edit.encode_guidance(["a red circle"], sources=[[source]], true_cfg_scale=1.0)
    assert inputs["source_grids"].tolist() == [[56, 74]]
    assert inputs["source_latents"].shape == (1, 56 * 74, 64)


def test_the_memory_plan_and_the_forward_cost_count_the_sources():
    """Qwen-Image-Edit at 1024 x 1024 with one 1024 x 1024 source: 4096 more image tokens in
    every DiT forward, the VAE's encoder in the weights and a phase of its own for the encode."""
    from ditfleet.model.family import source_size
    from ditfleet.model.memory import ModelMemory, Runtime, plan_memory
    from ditfleet.model.qwen_image.family import QWEN_IMAGE
    from ditfleet.model.qwen_image.published import PUBLISHED

    model = ModelMemory.from_dir(PUBLISHED / "qwen-image")
    assert source_size(1000, 1000) == (1024, 1024) and source_size(1664, 928) == (1376, 768)
    text = plan_memory(model, height=1024, width=1024, batch=1, run=Runtime(text_len=256))
    edit = plan_memory(
        model, height=1024, width=1024, batch=1, run=Runtime(text_len=256, sources=((1024, 1024),))
    )
    assert "source_encode" not in text.phases and edit.phases["source_encode"] > edit.weights["vae"]
    assert edit.weights["vae"] > text.weights["vae"]  # the encoder
    assert edit.activations["denoise"] > 1.9 * text.activations["denoise"]
    assert edit.peak > text.peak
    raw = QWEN_IMAGE.published_config("transformer/config.json")
    plain = QWEN_IMAGE.forward_flops(raw, 1024, 1024, 256)
    with_source = QWEN_IMAGE.forward_flops(raw, 1024, 1024, 256, source_tokens=4096)
    assert with_source == QWEN_IMAGE.forward_flops(raw, 1024, 2048, 256)  # as many tokens as a 2x image
    assert 2.2 < with_source / plain < 2.6


@pytest.mark.parametrize("cfg_mode", ["serial", "batched"])
def test_a_rows_edit_does_not_depend_on_its_batch(tmp_path, cfg_mode):
    """Two rows of different sources (the same size) in one batch, and 2511's split modulation:
    each row's image is the one it gets alone, with either CFG mode."""
    root = write_toy_edit_checkpoint(tmp_path / "m", zero_cond_t=True)
    pipe = load_pipeline(root, "cpu", cfg_mode=cfg_mode)
    pipe.edit = dataclasses.replace(pipe.edit, vae_area=128 * 128)
    a, b = _image(64, 48, seed=1), _image(64, 48, seed=2)
    kwargs = dict(height=48, width=64, steps=3)
    both = pipe.generate(["a red circle", "a blue square"], sources=[[a], [b]], seeds=[1, 2], **kwargs)
    alone = pipe.generate(["a blue square"], sources=[[b]], seeds=[2], **kwargs)
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=0)
    assert (both[0] - both[1]).abs().max() > 1e-3
