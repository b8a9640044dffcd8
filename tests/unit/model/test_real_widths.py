"""Qwen-Image at its published widths (one block deep) on the CPU, against diffusers on the same files.

The checkpoint (ditfleet/testing/real_widths.py) is what the hub ships, cut to one block: the published
configs, bf16 weights in four shards plus the index. Both implementations load the same files.
"""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ditfleet.model import load_pipeline
from ditfleet.model.generation.sampling import model_timestep
from ditfleet.model.generation.scheduler import SchedulerConfig, sigma_schedule
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.testing.models import load_transformer
from tests.support.model_fixtures import (
    diffusers_images,
    diffusers_pipeline,
    diffusers_transformer,
    guided_inputs,
    padded_embeds,
)

TEXT_DIM = 3584


def _text(seed: int, lens: list[int]):
    """Stand-in prompt embeddings at the text encoder's width, padded with a mask."""
    return padded_embeds(seed, lens, dim=TEXT_DIM, scale=4)


def _inputs(h: int, w: int, lens: list[int], dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(lens), h * w, 64, generator=g).to(dtype)
    txt, mask = _text(4, lens)
    return x, txt.to(dtype), mask, [[(1, h, w)]] * len(lens)


@pytest.mark.slow
def test_checkpoint_is_stored_like_the_hub(real_widths_dir):
    tdir = real_widths_dir / "transformer"
    shards = sorted(tdir.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    index = json.loads((tdir / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {s.name for s in shards}
    with safe_open(str(shards[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    config = json.loads((tdir / "config.json").read_text())
    assert config["pooled_projection_dim"] == 768 and config["num_layers"] == 1  # the published file, cut


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loads_through_load_pipeline(real_widths_dir, dtype):
    pipe = load_pipeline(real_widths_dir, dtype=dtype)
    t = pipe.transformer
    assert t.dtype == dtype and t.config.inner_dim == 3072 and t.config.joint_attention_dim == TEXT_DIM
    assert pipe.vae_dtype == dtype and pipe.text_encoder is None
    # The bf16 weights arrive unchanged (exactly, in bf16; exactly representable in fp32).
    shard = sorted((real_widths_dir / "transformer").glob("*-of-*.safetensors"))[-1]
    with safe_open(str(shard), "pt") as f:
        for k in list(f.keys())[:3]:
            assert torch.equal(t.state_dict()[k], f.get_tensor(k).to(dtype))
    del pipe, t
    gc.collect()


def _transformer_outputs(root, dtype: torch.dtype, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, diffusers') transformer output in fp32, both loaded in `dtype` from the same files."""
    ref = diffusers_transformer(root, dtype)
    ours = load_transformer(root / "transformer", "cpu", dtype)
    x, txt, mask, shapes = _inputs(16, 16, [12, 7], dtype)
    with torch.no_grad():
        expected = ref(x, txt, mask, t, shapes, return_dict=False)[0].float()
        got = ours(x, txt, mask, t, shapes).float()
    del ref, ours
    gc.collect()
    return got, expected


@pytest.mark.slow
def test_fp32_transformer_matches_diffusers(real_widths_dir):
    got, expected = _transformer_outputs(real_widths_dir, torch.float32, torch.tensor([0.6, 0.6]))
    assert (got - expected).abs().max().item() <= 2e-4


@pytest.mark.slow
def test_bf16_transformer_within_one_percent_of_diffusers(real_widths_dir):
    t = model_timestep(torch.tensor([607.0, 607.0]), torch.bfloat16)
    got, expected = _transformer_outputs(real_widths_dir, torch.bfloat16, t)
    assert (got - expected).norm().item() <= 0.01 * expected.norm().item()


def test_bf16_timesteps_are_rounded_like_the_reference():
    """t is rounded to bf16 and then divided; dividing first lands elsewhere (256x256, 8 steps)."""
    sigmas = sigma_schedule(SchedulerConfig(), 8, 256)
    ts = sigmas[:-1] * 1000.0
    ours = [model_timestep(ts[i : i + 1], torch.bfloat16) for i in range(8)]
    reference = [ts[i : i + 1].to(torch.bfloat16) / 1000 for i in range(8)]  # the reference pipeline
    divided_first = [(ts[i : i + 1] / 1000).to(torch.bfloat16) for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
    assert not all(torch.equal(a, b) for a, b in zip(ours, divided_first))
    # the sixth step: t = 391.3 -> 0.3926 as the reference has it, 0.3906 when divided first
    assert round(ours[5].item(), 4) == 0.3926 and round(divided_first[5].item(), 4) == 0.3906


@pytest.mark.slow
def test_pipeline_256_three_steps_true_cfg_matches_diffusers(real_widths_dir):
    inputs = guided_inputs([9], [3], height=256, width=256, dim=TEXT_DIM, scale=4)
    ref = diffusers_pipeline(real_widths_dir, torch.float32)
    expected = diffusers_images(ref, steps=3, seeds=[5], **inputs)
    del ref
    gc.collect()
    pipe = load_pipeline(real_widths_dir, dtype=torch.float32)
    got = pipe.generate(**inputs, steps=3, seeds=[5])
    assert got.shape == expected.shape == (1, 3, 256, 256)
    assert (got - expected).abs().max().item() <= 2e-3
    del pipe
    gc.collect()


class _Recorder:
    """(timestep, output) of every transformer call."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def ours(self, module, args, kwargs, output):
        # The shared denoise loop calls the DiT with the family's prepared inputs, by keyword.
        timestep = kwargs["timestep"] if "timestep" in kwargs else args[3]
        self.calls.append((timestep.detach().clone(), output.detach().float().clone()))

    def reference(self, module, args, kwargs, output):
        out = output[0] if isinstance(output, tuple) else output.sample
        self.calls.append((kwargs["timestep"].detach().clone(), out.detach().float().clone()))


@pytest.mark.slow
def test_bf16_trajectory_follows_diffusers_step_by_step(real_widths_dir):
    """Each step: the same bf16 timestep tensor value, and a DiT output within 1% of the reference's."""
    ref = diffusers_pipeline(real_widths_dir, torch.bfloat16)
    pipe = load_pipeline(real_widths_dir, dtype=torch.bfloat16)
    pos, pos_mask = _text(0, [9])
    for height, width, steps in [(256, 256, 8), (128, 256, 5), (128, 128, 4)]:
        rec_ref, rec_ours = _Recorder(), _Recorder()
        h1 = ref.transformer.register_forward_hook(rec_ref.reference, with_kwargs=True)
        h2 = pipe.transformer.register_forward_hook(rec_ours.ours, with_kwargs=True)
        size = dict(height=height, width=width, steps=steps, true_cfg_scale=1.0, seeds=[2])
        diffusers_images(
            ref,
            prompt_embeds=pos.to(torch.bfloat16),
            prompt_embeds_mask=pos_mask,
            output_type="latent",
            **size,
        )
        # Latents only, as the reference: a bf16 VAE decode at full width takes minutes on a CPU.
        pipe.generate(prompt_embeds=pos, prompt_embeds_mask=pos_mask, decode=False, **size)
        h1.remove(), h2.remove()
        assert len(rec_ref.calls) == len(rec_ours.calls) == steps
        for i, ((t_ref, v_ref), (t_ours, v_ours)) in enumerate(zip(rec_ref.calls, rec_ours.calls)):
            assert t_ours.dtype == t_ref.dtype == torch.bfloat16
            assert torch.equal(t_ours.reshape(-1)[:1], t_ref.reshape(-1)[:1]), (height, width, steps, i)
            rel = (v_ours - v_ref).norm().item() / v_ref.norm().item()
            assert rel <= 0.01, f"{width}x{height}, {steps} steps, step {i}: DiT output {rel:.2%} off"
    del ref, pipe
    gc.collect()


def test_published_schedule_timesteps_equal_diffusers():
    """The fp32 t the scheduler hands out is diffusers' to the bit, so the bf16 rounding agrees too."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(PUBLISHED / "qwen-image" / "scheduler")
    for steps in [2, 3, 4, 5, 8, 13, 20, 28, 30, 40, 50, 100]:
        for tokens in [16, 64, 128, 256, 1024, 4096, 6032, 6348, 6534, 6889, 8192]:
            mu = calculate_shift(tokens, 256, 8192, 0.5, 0.9)
            ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            ours = sigma_schedule(SchedulerConfig(), steps, tokens)
            assert torch.equal(ours[:-1] * 1000.0, ref.timesteps), (steps, tokens)
            assert torch.equal(ours, ref.sigmas), (steps, tokens)
