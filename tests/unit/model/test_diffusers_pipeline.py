"""The diffusers family's adapter against diffusers itself, on toy checkpoints built here with
diffusers' own classes (fp32 CPU, bitwise): a second pipeline class (SD3, three text encoders and
true CFG), a LoRA through diffusers' loader, an edit pipeline (SD3 image-to-image) given the
rows' source images, and the text encoders kept on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ditfleet.model.diffusers_pipeline.index import call_defaults
from ditfleet.model.family import model_family
from ditfleet.model.generation.pipeline import Sampling
from ditfleet.model.loading.lora_spec import LoraSpec
from ditfleet.model.settings import PipelineSettings
from ditfleet.testing.diffusers_models import make_flux_dir, make_sd3_dir

PROMPTS = ["a red circle on a white background", "a small blue square"]
SEEDS = [11, 12]


def _ours(root: Path, scale: float, negative: str | None, **kwargs) -> torch.Tensor:
    family = model_family(str(root))
    pipe = family.load_pipeline(
        root, device="cpu", dtype=torch.float32, settings=PipelineSettings(), model_revision="r", batch_size=2,
        **kwargs,
    )  # fmt: skip
    negatives = None if negative is None else [negative] * len(PROMPTS)
    # The text length the job resolves where it sets none: the pipeline's own (jobs/spec/sampling_defaults).
    text_length = call_defaults(pipe.family.class_name)["max_sequence_length"]
    inputs = pipe.encode_guidance(PROMPTS, negatives, scale, text_length)
    return pipe.run(inputs, Sampling(32, 48, 3, SEEDS, scale)).images


def _theirs(pipe, scale: float, negative: str | None) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    extra = {} if negative is None else {"negative_prompt": [negative] * len(PROMPTS)}
    return pipe(
        prompt=PROMPTS, height=32, width=48, num_inference_steps=3, guidance_scale=scale,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="pt", **extra,
    ).images  # fmt: skip


def test_sd3_with_true_cfg_is_diffusers_bitwise(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    root = make_sd3_dir(tmp_path / "sd3")
    assert model_family(str(root)).name == "diffusers:StableDiffusion3Pipeline"
    ours = _ours(root, 5.0, "blurry")
    theirs = _theirs(StableDiffusion3Pipeline.from_pretrained(root), 5.0, "blurry")
    assert ours.shape == (2, 3, 32, 48) and torch.equal(ours, theirs)


@pytest.fixture
def flux_with_lora(tmp_path) -> tuple[Path, Path]:
    from diffusers import FluxPipeline
    from peft import LoraConfig

    root = make_flux_dir(tmp_path / "flux")
    pipe = FluxPipeline.from_pretrained(root)
    pipe.transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    )
    torch.manual_seed(3)
    with torch.no_grad():  # peft starts B at zero: make the adapter change something
        for name, p in pipe.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    from peft.utils import get_peft_model_state_dict

    FluxPipeline.save_lora_weights(
        tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(pipe.transformer)
    )
    return root, tmp_path / "lora" / "pytorch_lora_weights.safetensors"


def test_a_lora_goes_through_diffusers_loader_at_its_scale(flux_with_lora):
    from diffusers import FluxPipeline

    root, lora = flux_with_lora
    ours = _ours(root, 3.5, None, loras=(LoraSpec(str(lora), 0.7),))
    reference = FluxPipeline.from_pretrained(root)
    plain = _theirs(reference, 3.5, None)
    reference.load_lora_weights(str(lora), adapter_name="a")
    reference.set_adapters(["a"], adapter_weights=[0.7])
    reference.fuse_lora(adapter_names=["a"])
    reference.unload_lora_weights()
    assert not torch.equal(ours, plain), "the adapter changed nothing"
    assert torch.equal(ours, _theirs(reference, 3.5, None))


def _sources(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB source image of (width, height) `size`, as an edit row's column decodes to."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def test_an_edit_pipeline_gets_each_rows_source_bitwise_as_diffusers_per_image(tmp_path):
    """SD3 image-to-image: task "edit"; each row's source (a size other than the output's: the
    pipeline resizes it) goes to `image`, one generator per image. At batch size 1 every image
    equals diffusers called directly on that row; at batch size 2 each call is diffusers' on the
    same padded batch, and a row gives the same bytes whichever rows share its batch."""
    from diffusers import StableDiffusion3Img2ImgPipeline

    root = make_sd3_dir(tmp_path / "sd3-img2img", img2img=True)
    family = model_family(str(root))
    assert family.task({"_class_name": "StableDiffusion3Img2ImgPipeline"}) == "edit"  # type: ignore[attr-defined]
    sources = [[_sources(1, (40, 56))], [_sources(2, (64, 32))], [_sources(3, (48, 32))]]
    prompts, seeds = [*PROMPTS, "a green triangle"], [*SEEDS, 13]
    reference = StableDiffusion3Img2ImgPipeline.from_pretrained(root)
    reference.set_progress_bar_config(disable=True)

    def theirs(rows: list[int]) -> torch.Tensor:
        return reference(
            prompt=[prompts[i] for i in rows], image=[sources[i][0] for i in rows], height=32, width=48,
            num_inference_steps=5, guidance_scale=5.0,
            generator=[torch.Generator().manual_seed(seeds[i]) for i in rows], output_type="pt",
        ).images  # fmt: skip

    def ours(batch_size: int, rows: list[int]) -> torch.Tensor:
        pipe = family.load_pipeline(
            root, device="cpu", dtype=torch.float32, model_revision="r", batch_size=batch_size
        )
        picked = [sources[i] for i in rows]
        inputs = pipe.encode_guidance([prompts[i] for i in rows], [""] * len(rows), 5.0, 256, sources=picked)
        return pipe.run(inputs, Sampling(32, 48, 5, [seeds[i] for i in rows], 5.0)).images

    one_by_one = ours(1, [0, 1, 2])
    for i in range(3):
        assert torch.equal(one_by_one[i : i + 1], theirs([i])), f"row {i} differs from diffusers on that row"
    batched = ours(2, [0, 1, 2])
    assert torch.equal(batched[:2], theirs([0, 1]))
    assert torch.equal(batched[2:], theirs([2, 2])[:1])  # the last batch padded with its own copy
    assert torch.equal(ours(2, [2]), batched[2:]), "a row's bytes depend on which rows share its batch"
    # Warm-up (compile.warmup) calls without sources: an edit pipeline gets a grey one per prompt.
    pipe = family.load_pipeline(root, device="cpu", dtype=torch.float32, model_revision="r", batch_size=2)
    warm = pipe.generate(["a red circle"], height=32, width=48, steps=2, seeds=[1], max_sequence_length=256)
    assert warm.shape == (1, 3, 32, 48)
    assert not torch.equal(batched[0], batched[1])


def test_text_encoders_on_the_cpu_give_the_same_images(tmp_path):
    """model.text_encoder: cpu (text_encoders_on_cpu): the encoders' inputs and outputs cross to
    their device through hooks, every ModelOutput field included; on a CPU actor the images are
    bitwise the plain pipeline's (on a GPU the embeddings are moved to it the same way)."""
    from ditfleet.model.diffusers_pipeline.loader import text_encoders_on_cpu

    root = make_sd3_dir(tmp_path / "sd3")
    plain = _ours(root, 5.0, "blurry")
    family = model_family(str(root))
    pipe = family.load_pipeline(root, device="cpu", dtype=torch.float32, model_revision="r", batch_size=2)
    text_encoders_on_cpu(pipe.pipeline, torch.device("cpu"))
    hooked = [
        n for n, m in pipe.pipeline.components.items() if n.startswith("text_encoder") and m._forward_hooks
    ]
    assert hooked == ["text_encoder", "text_encoder_2", "text_encoder_3"]
    inputs = pipe.encode_guidance(PROMPTS, ["blurry"] * 2, 5.0, 256)
    assert torch.equal(pipe.run(inputs, Sampling(32, 48, 3, SEEDS, 5.0)).images, plain)
