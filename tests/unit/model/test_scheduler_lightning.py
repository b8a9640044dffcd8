"""The few-step distilled Qwen-Image-Lightning schedule: its published scheduler config loads, and
every sigma and timestep equals what diffusers' FlowMatchEulerDiscreteScheduler computes for it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ditfleet.model.generation.scheduler import SchedulerConfig, sigma_schedule
from ditfleet.model.qwen_image.loader import load_scheduler
from ditfleet.model.qwen_image.published import PUBLISHED

LIGHTNING = PUBLISHED / "qwen-image-lightning" / "scheduler"
QWEN_IMAGE = SchedulerConfig()  # Qwen-Image's own settings are the defaults


def _diffusers(config_dir: Path, steps: int, image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) as QwenImagePipeline sets them up for `steps` at this image size."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(config_dir)
    c = ref.config
    mu = calculate_shift(image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return ref.sigmas, ref.timesteps


def test_the_published_lightning_config_is_read_key_by_key():
    raw = json.loads((LIGHTNING / "scheduler_config.json").read_text())
    config = load_scheduler(LIGHTNING)
    # Shift 3 at every size (base = max = ln 3), and no stretch to a terminal sigma.
    assert config.base_shift == config.max_shift == raw["base_shift"] == math.log(3)
    assert config.shift_terminal is None and config.use_dynamic_shifting
    assert config.time_shift_type == "exponential" and config.shift == 1.0
    assert config != QWEN_IMAGE


@pytest.mark.parametrize("steps", [4, 8])
@pytest.mark.parametrize("size", [(1328, 1328), (1664, 928), (512, 512), (256, 256)])
def test_lightning_sigmas_and_timesteps_equal_diffusers(steps, size):
    w, h = size
    seq_len = (w // 16) * (h // 16)
    ref_sigmas, ref_timesteps = _diffusers(LIGHTNING, steps, seq_len)
    sigmas = sigma_schedule(load_scheduler(LIGHTNING), steps, seq_len)
    assert torch.equal(sigmas, ref_sigmas), (sigmas, ref_sigmas)
    # What the denoising loop hands the model before dividing by 1000: sigma * 1000.
    assert torch.equal(sigmas[:-1] * 1000.0, ref_timesteps)
    # A constant shift of 3: sigma' = 3 s / (1 + 2 s) of the linear sigmas, whatever the size.
    lin = torch.linspace(1.0, 1 / steps, steps, dtype=torch.float64)
    assert torch.allclose(sigmas[:-1].double(), 3 * lin / (1 + 2 * lin), atol=1e-6)


def test_lightning_schedule_differs_from_qwen_image_where_it_should():
    """Same steps and size, different schedule: no terminal stretch and a larger shift."""
    light = sigma_schedule(load_scheduler(LIGHTNING), 8, 4096)
    base = sigma_schedule(QWEN_IMAGE, 8, 4096)
    assert light[-2] > 0.25 and abs(float(base[-2]) - 0.02) < 1e-6
    assert not torch.equal(light, base)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_karras_sigmas": True}, "not supported"),
        ({"stochastic_sampling": True}, "not supported"),
        ({"time_shift_type": "cosine"}, "time_shift_type"),
        ({"num_train_timesteps": 500}, "num_train_timesteps"),
        ({"_class_name": "EulerDiscreteScheduler"}, "only 'FlowMatchEulerDiscreteScheduler'"),
        ({"shift_terminal": 1.5}, "shift_terminal"),
    ],
)
def test_a_config_asking_for_another_schedule_is_refused(tmp_path, change, message):
    config = {**json.loads((LIGHTNING / "scheduler_config.json").read_text()), **change}
    (tmp_path / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as e:
        load_scheduler(tmp_path)
    assert str(tmp_path / "scheduler_config.json") in str(e.value)


def test_a_merged_checkpoint_brings_its_schedule_and_an_override_wins(tmp_path, random_model_dir):
    """A distilled checkpoint in the diffusers layout: its scheduler/ folder is the schedule used;
    model.scheduler_config (a file or a folder) replaces whatever the checkpoint has."""
    import shutil

    from ditfleet.model import load_pipeline

    merged = tmp_path / "lightning-merged"
    shutil.copytree(random_model_dir, merged)
    shutil.copy(LIGHTNING / "scheduler_config.json", merged / "scheduler" / "scheduler_config.json")
    assert load_pipeline(merged, load_text_encoder_too=False).scheduler == load_scheduler(LIGHTNING)
    base = load_pipeline(random_model_dir, load_text_encoder_too=False)
    assert base.scheduler == QWEN_IMAGE
    for override in (LIGHTNING, LIGHTNING / "scheduler_config.json"):
        pipe = load_pipeline(random_model_dir, scheduler_config=override, load_text_encoder_too=False)
        assert pipe.scheduler == load_scheduler(LIGHTNING) and pipe.model_revision != base.model_revision
    missing = tmp_path / "nowhere" / "scheduler_config.json"
    with pytest.raises(ValueError, match=r"nowhere/scheduler_config\.json: missing"):
        load_pipeline(random_model_dir, scheduler_config=missing, load_text_encoder_too=False)
    (tmp_path / "broken.json").write_text("{'shift': 3")
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        load_pipeline(
            random_model_dir, scheduler_config=tmp_path / "broken.json", load_text_encoder_too=False
        )
