"""The diffusers family's adapter against diffusers itself, on toy checkpoints built here with
diffusers' own classes (fp32 CPU, bitwise): a second pipeline class (SD3, three text encoders and
true CFG), and a LoRA through diffusers' loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    inputs = pipe.encode_guidance(PROMPTS, negatives, scale, 64)
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
