"""The few-step checkpoints run as their publishers give them: a toy-width random checkpoint with
each published few-step scheduler (nvidia/Qwen-Image-Flash's, Qwen-Image-Lightning's), sampled at
the published steps with CFG off, gives what diffusers' QwenImagePipeline gives on the same
weights and seeds (fp32 CPU, within 1e-4)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.generation.scheduler import sigma_schedule
from ditfleet.model.qwen_image.loader import load_scheduler
from ditfleet.model.qwen_image.published.schedules import FLASH, LIGHTNING, LIGHTNING_LORAS, by_scheduler
from ditfleet.testing.models import make_diffusers_model_dir
from tests.support.model_fixtures import diffusers_images, diffusers_pipeline, padded_embeds


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_diffusers_model_dir(tmp_path_factory.mktemp("few-step") / "base", seed=3)


def with_scheduler(base, tmp_path, schedule):
    """The base checkpoint's weights with `schedule`'s published scheduler folder."""
    root = tmp_path / schedule.folder
    root.mkdir()
    for name in ("transformer", "vae", "model_index.json"):
        (root / name).symlink_to(base / name)
    (root / "scheduler").mkdir()
    shutil.copy(schedule.scheduler_path(), root / "scheduler" / "scheduler_config.json")
    return root


def test_flash_runs_the_four_step_shift_3_trajectory():
    """What the card says ("the four-step, shift-3 trajectory"), whatever the image size."""
    config = load_scheduler(FLASH.scheduler_path())
    for seq_len in (16, 4096, 6889):
        sigmas = sigma_schedule(config, FLASH.steps, seq_len)
        assert torch.allclose(sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-7)


@pytest.mark.parametrize(
    "schedule", [FLASH, LIGHTNING, *LIGHTNING_LORAS], ids=lambda s: f"{s.folder}-{s.steps}"
)
def test_published_few_step_schedule_matches_diffusers(base_dir, tmp_path, schedule):
    root = with_scheduler(base_dir, tmp_path, schedule)
    written = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    assert by_scheduler(written) is (FLASH if schedule is FLASH else LIGHTNING)
    pos, mask = padded_embeds(0, [6, 3])
    # CFG off as published: no negative prompt, scale 1; one DiT pass per step.
    inputs = dict(prompt_embeds=pos, prompt_embeds_mask=mask, height=64, width=96, true_cfg_scale=1.0)
    expected = diffusers_images(diffusers_pipeline(root), steps=schedule.steps, seeds=[5, 6], **inputs)
    got = load_pipeline(root).generate(**inputs, steps=schedule.steps, seeds=[5, 6])
    assert got.shape == expected.shape == (2, 3, 64, 96)
    assert (got - expected).abs().max().item() <= 1e-4


def test_a_lightning_lora_job_runs_the_published_scheduler_over_the_base(base_dir):
    """The LoRA form: the base checkpoint's own scheduler is replaced by Lightning's (what
    jobs.spec.sampling_defaults hands the worker as scheduler_config)."""
    lora = LIGHTNING_LORAS[0]
    pos, mask = padded_embeds(0, [4])
    inputs = dict(prompt_embeds=pos, prompt_embeds_mask=mask, height=64, width=64, true_cfg_scale=1.0)
    over = load_pipeline(base_dir, scheduler_config=lora.scheduler_path())
    base = load_pipeline(base_dir)
    a = over.generate(**inputs, steps=lora.steps, seeds=[1])
    b = base.generate(**inputs, steps=lora.steps, seeds=[1])
    assert not torch.equal(a, b), "Lightning's schedule is not Qwen-Image's"
