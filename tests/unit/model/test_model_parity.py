"""Our model computes what diffusers computes on the same weights (tiny random configs, CPU fp32)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import TransformerConfig, WeightsError, load_pipeline
from ditfleet.testing.models import TINY_TRANSFORMER, load_transformer
from tests.support.model_fixtures import (
    diffusers_images,
    diffusers_pipeline,
    guided_inputs,
    padded_embeds,
    text_mask,
)


def _reference_transformer(**overrides):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(1)
    return QwenImageTransformer2DModel(**{**TINY_TRANSFORMER, **overrides}).eval()


@pytest.mark.parametrize(
    "grid, text_lens, overrides",
    [
        ((4, 4), (5, 5), {}),  # square, no padding
        ((3, 6), (7, 4), {}),  # non-square, batch 2 with different prompt lengths (padding masked)
        ((6, 2), (6, 1), {"use_additional_t_cond": True}),
    ],
)
def test_transformer_matches_diffusers(tmp_path, grid, text_lens, overrides):
    ref = _reference_transformer(**overrides)
    ref.save_pretrained(tmp_path / "transformer")
    ours = load_transformer(tmp_path / "transformer", "cpu", torch.float32)
    h, w = grid
    B, L = len(text_lens), max(text_lens)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, h * w, 64, generator=g)
    txt = torch.randn(B, L, 16, generator=g)
    mask = text_mask(list(text_lens))
    t = torch.tensor([0.73] * B)
    extra = torch.tensor([0, 1]) if overrides.get("use_additional_t_cond") else None
    shapes = [[(1, h, w)]] * B
    with torch.no_grad():
        expected = ref(
            hidden_states=x,
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=mask,
            timestep=t,
            img_shapes=shapes,
            additional_t_cond=extra,
            return_dict=False,
        )[0]
        got = ours(x, txt, mask, t, shapes, additional_t_cond=extra)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_module_tree_mirrors_diffusers_keys(tmp_path):
    ref = _reference_transformer()
    ours = TransformerConfig.from_dict(dict(ref.config))
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer

    assert set(QwenImageTransformer(ours).state_dict()) == set(ref.state_dict())
    block = QwenImageTransformer(ours).transformer_blocks[0]
    assert isinstance(block.img_mod[1], torch.nn.Linear)


def test_pipeline_matches_diffusers(random_model_dir):
    """Same embeddings, seeds, 4 steps, true_cfg_scale 4: images within 1e-3 per pixel."""
    inputs = guided_inputs([6, 3], [2, 2], height=64, width=96)
    expected = diffusers_images(diffusers_pipeline(random_model_dir), steps=4, seeds=[11, 12], **inputs)
    got = load_pipeline(random_model_dir).generate(**inputs, steps=4, seeds=[11, 12])
    assert got.shape == expected.shape == (2, 3, 64, 96)
    assert (got - expected).abs().max().item() <= 1e-3


def test_scheduler_matches_diffusers(random_model_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from ditfleet.model.generation.scheduler import sigma_schedule
    from ditfleet.model.qwen_image.loader import load_scheduler

    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(random_model_dir / "scheduler")
    ours = load_scheduler(random_model_dir / "scheduler")
    for steps, seq_len in [(4, 24), (50, 4096), (30, 6889)]:
        import numpy as np

        mu = calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert torch.equal(sigma_schedule(ours, steps, seq_len), ref.sigmas)


def test_same_seed_same_image_whatever_the_batch(random_model_dir):
    pipe = load_pipeline(random_model_dir)
    pos, mask = padded_embeds(0, [5, 5, 5])
    kw = dict(height=32, width=32, steps=2, true_cfg_scale=1.0)
    batch = pipe.generate(prompt_embeds=pos, prompt_embeds_mask=mask, seeds=[7, 8, 9], **kw)
    alone = pipe.generate(prompt_embeds=pos[1:2], prompt_embeds_mask=mask[1:2], seeds=[8], **kw)
    assert torch.allclose(batch[1:2], alone, atol=1e-5)


def test_missing_and_pickle_weights_are_refused(tmp_path, random_model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(random_model_dir, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(WeightsError, match=r"missing \['vae'\]"):
        load_pipeline(broken)
    pickled = tmp_path / "pickled"
    shutil.copytree(random_model_dir, pickled)
    for f in (pickled / "transformer").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(WeightsError, match="pickle"):
        load_pipeline(pickled)


def test_one_step_schedule_is_finite():
    from ditfleet.model.generation.scheduler import SchedulerConfig, sigma_schedule

    sigmas = sigma_schedule(SchedulerConfig(), 1, 1024)
    assert torch.isfinite(sigmas).all() and sigmas.tolist() == [1.0, 0.0]


def test_batched_cfg_matches_serial(random_model_dir):
    """cond+uncond in one batch of 2B computes what two serial passes compute."""
    from ditfleet.testing.prompt_padding import encode_padded

    serial = load_pipeline(random_model_dir)
    batched = load_pipeline(random_model_dir, cfg_mode="batched")
    prompts = ["a small red circle", "a large blue square at the top left on a white background"]
    kw = dict(height=32, width=48, steps=3, true_cfg_scale=4.0, seeds=[1, 2])
    a = serial.generate(**encode_padded(serial, prompts, " ", 4.0), **kw)
    b = batched.generate(**encode_padded(batched, prompts, " ", 4.0), **kw)
    assert (a - b).abs().max().item() <= 1e-4
