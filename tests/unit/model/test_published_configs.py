"""The config files of the published Qwen-Image checkpoints load as shipped (model/qwen_image/published).

Keys that do not change the computation are ignored (once, at debug level), keys that would are
refused, and the full-depth transformer built from the published config has the published size.
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from ditfleet.model.family import check_model_index, model_task
from ditfleet.model.generation.scheduler import SchedulerConfig, sigma_schedule
from ditfleet.model.loading import folder
from ditfleet.model.qwen_image.family import QWEN_IMAGE
from ditfleet.model.qwen_image.loader import load_scheduler
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.qwen_image.vae import VAEConfig, load_vae

MODELS = ["qwen-image", "qwen-image-2512"]
# Parameters of the published 60-layer transformer: its nine bf16 shards hold 40,860,802,176 bytes
# of weights (1933 tensors), i.e. 20,430,401,088 parameters.
PUBLISHED_TRANSFORMER_PARAMS = 20_430_401_088
PUBLISHED_TRANSFORMER_TENSORS = 1933


def _json(model: str, rel: str) -> dict:
    return json.loads((PUBLISHED / model / rel).read_text())


@pytest.mark.parametrize("model", MODELS)
def test_published_transformer_config_loads(model):
    cfg = TransformerConfig.from_dict(_json(model, "transformer/config.json"))
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim) == (60, 24, 128)
    assert (cfg.inner_dim, cfg.joint_attention_dim, cfg.in_channels, cfg.out_channels) == (3072, 3584, 64, 16)
    assert cfg.axes_dims_rope == (16, 56, 56)


def test_pooled_projection_dim_is_ignored_once_at_debug(caplog):
    raw = _json("qwen-image", "transformer/config.json")
    assert raw["pooled_projection_dim"] == 768  # the key the published file really carries
    folder._ignored_seen.discard(("transformer", "pooled_projection_dim"))
    with caplog.at_level(logging.DEBUG, logger="ditfleet.model.loading.folder"):
        TransformerConfig.from_dict(raw)
        TransformerConfig.from_dict(raw)
    hits = [r for r in caplog.records if "pooled_projection_dim" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.DEBUG


@pytest.mark.parametrize(
    "key, value",
    [("guidance_embeds", True), ("use_layer3d_rope", True), ("num_single_layers", 38)],
)
def test_keys_that_change_the_model_are_refused(key, value):
    raw = {**_json("qwen-image", "transformer/config.json"), key: value}
    with pytest.raises(ValueError, match=f"x/config.json.*{key}"):
        TransformerConfig.from_dict(raw, where="x/config.json")


def test_transformer_config_of_another_architecture_is_refused():
    flux = {
        "_class_name": "FluxTransformer2DModel",
        "attention_head_dim": 128,
        "guidance_embeds": True,
        "in_channels": 64,
        "joint_attention_dim": 4096,
        "num_attention_heads": 24,
        "num_layers": 19,
        "num_single_layers": 38,
        "patch_size": 1,
        "pooled_projection_dim": 768,
    }
    with pytest.raises(ValueError, match="flux/transformer/config.json.*FluxTransformer2DModel"):
        TransformerConfig.from_dict(flux, where="flux/transformer/config.json")


@pytest.mark.parametrize("model", MODELS)
def test_published_vae_and_scheduler_configs_load(model):
    vae = VAEConfig.from_dict(_json(model, "vae/config.json"))
    assert (vae.z_dim, vae.base_dim, vae.dim_mult, vae.spatial_compression) == (16, 96, (1, 2, 4, 4), 8)
    sched = load_scheduler(PUBLISHED / model / "scheduler")
    assert sched == SchedulerConfig()  # the defaults are Qwen-Image's published schedule


@pytest.mark.parametrize("model", MODELS)
def test_published_schedule_matches_diffusers(model):
    from diffusers import FlowMatchEulerDiscreteScheduler

    raw = _json(model, "scheduler/scheduler_config.json")
    ref = FlowMatchEulerDiscreteScheduler.from_config(raw)
    ours = SchedulerConfig.from_dict(raw)
    for steps, tokens in [(8, 256), (50, 4096), (30, 6889)]:
        mu = _diffusers_mu(tokens, ref.config)
        # What QwenImagePipeline hands the scheduler: linspace(1, 1/steps) and mu from the token count.
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=mu)
        torch.testing.assert_close(sigma_schedule(ours, steps, tokens), ref.sigmas.float(), rtol=0, atol=1e-6)


def _diffusers_mu(image_seq_len: int, c) -> float:
    m = (c.max_shift - c.base_shift) / (c.max_image_seq_len - c.base_image_seq_len)
    return image_seq_len * m + c.base_shift - m * c.base_image_seq_len


def test_scheduler_of_another_kind_is_refused(tmp_path):
    raw = {**_json("qwen-image", "scheduler/scheduler_config.json"), "_class_name": "DDIMScheduler"}
    (tmp_path / "scheduler_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="scheduler_config.json.*DDIMScheduler"):
        load_scheduler(tmp_path)


@pytest.mark.parametrize("model", MODELS)
def test_model_index_is_accepted(model):
    check_model_index(PUBLISHED / model)


@pytest.mark.parametrize("class_name", ["QwenImageEditPipeline", "QwenImageEditPlusPipeline"])
def test_model_index_of_an_edit_pipeline_is_the_family_edit_task(tmp_path, class_name):
    shutil.copytree(PUBLISHED / "qwen-image", tmp_path / "m")
    index = {**_json("qwen-image", "model_index.json"), "_class_name": class_name}
    (tmp_path / "m" / "model_index.json").write_text(json.dumps(index))
    assert check_model_index(tmp_path / "m") is QWEN_IMAGE
    assert model_task(tmp_path / "m") == "edit" and model_task(PUBLISHED / "qwen-image") == "text-to-image"
    assert model_task("s3://bucket/edit-model", index) == "edit"


@pytest.mark.parametrize("model", MODELS)
def test_full_depth_transformer_on_meta_has_the_published_size(model):
    from diffusers import QwenImageTransformer2DModel

    raw = _json(model, "transformer/config.json")
    with torch.device("meta"):
        ours = QwenImageTransformer(TransformerConfig.from_dict(raw))
        ref = QwenImageTransformer2DModel.from_config(raw)
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert len(ours_state) == PUBLISHED_TRANSFORMER_TENSORS
    assert {k: tuple(v.shape) for k, v in ours_state.items()} == {
        k: tuple(v.shape) for k, v in ref_state.items()
    }
    assert sum(p.numel() for p in ours.parameters()) == PUBLISHED_TRANSFORMER_PARAMS


@pytest.mark.slow
def test_published_vae_builds_and_loads_strictly(tmp_path):
    """The full published VAE (decoder and encoder) round-trips through the diffusers layout."""
    from diffusers import AutoencoderKLQwenImage

    raw = _json("qwen-image", "vae/config.json")
    torch.manual_seed(0)
    ref = AutoencoderKLQwenImage.from_config(raw)
    out = tmp_path / "vae"
    ref.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(raw))  # exactly the published file, not a re-save
    ours, theirs = load_vae(out, with_encoder=True).state_dict(), ref.state_dict()
    # Every tensor came from the file: a 3D conv's last time tap (the only one that meets a single
    # frame), the rest as stored; only the video-only time_conv tensors are left out.
    assert sorted(set(theirs) - set(ours)) == sorted(k for k in theirs if ".time_conv." in k)
    for key, got in ours.items():
        want = theirs[key][:, :, -1] if theirs[key].dim() == 5 else theirs[key]
        assert torch.equal(got, want.reshape(got.shape)), key
