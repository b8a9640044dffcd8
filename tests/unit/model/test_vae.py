"""The 2D Qwen-Image VAE against diffusers' 3D `AutoencoderKLQwenImage` (the reference), on a tiny
random-weight model: decode, encode, the 3D <-> 2D weight mapping, and loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ditfleet.model.loading.weights import WeightsError
from ditfleet.model.qwen_image.vae import QwenImageVAE, VAEConfig, load_vae, save_vae, vae_state_dict_3d
from ditfleet.model.qwen_image.vae_blocks import RMSNorm

diffusers = pytest.importorskip("diffusers")
AutoencoderKLQwenImage = diffusers.AutoencoderKLQwenImage

TINY = dict(
    base_dim=32, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]
)
ATOL = 1e-4


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Perturb every parameter, gammas included (ones by default, which would hide a mixed-up norm),
    and scale the output conv so that part of the image hits the clamp."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.mul_(1.0 + 0.1 * noise)
        for name, p in module.named_parameters():
            if name.startswith("decoder.conv_out"):
                p.mul_(8.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[AutoencoderKLQwenImage, Path]:
    torch.manual_seed(0)
    ref = AutoencoderKLQwenImage(**TINY).eval()
    _randomise(ref, seed=1)
    out = tmp_path_factory.mktemp("vae")
    ref.save_pretrained(out, safe_serialization=True)
    return ref, out


@pytest.fixture(scope="module")
def ours(reference: tuple[AutoencoderKLQwenImage, Path]) -> QwenImageVAE:
    return load_vae(reference[1], device="cpu", dtype=torch.float32, with_encoder=True)


def _diffusers_decode(ref: AutoencoderKLQwenImage, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref.decode(z[:, :, None]).sample[:, :, 0]


@pytest.mark.slow
@pytest.mark.parametrize("hw", [(8, 8), (6, 10)])
def test_decode_matches_diffusers(reference, ours, hw) -> None:
    ref, _ = reference
    z = torch.randn(2, 16, *hw, generator=torch.Generator().manual_seed(2))
    want = _diffusers_decode(ref, z)
    with torch.no_grad():
        got = ours.decode(z)
    assert got.shape == (2, 3, 8 * hw[0], 8 * hw[1])
    assert (got - want).abs().max().item() < ATOL
    clamped = (want.abs() == 1.0).float().mean().item()
    assert 0.05 < clamped < 0.95, (
        f"{clamped:.2f} of pixels clamped: the test would not see the clamp or the values"
    )


@pytest.mark.slow
def test_encode_matches_diffusers(reference, ours) -> None:
    ref, _ = reference
    x = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        dist = ref.encode(x[:, :, None]).latent_dist
        mean, logvar = ours.encode_moments(x)
        assert torch.equal(ours.encode(x), mean)
    assert mean.shape == (2, 16, 8, 6)
    assert (mean - dist.mean[:, :, 0]).abs().max().item() < ATOL
    assert (logvar - dist.logvar[:, :, 0]).abs().max().item() < ATOL
    with pytest.raises(ValueError, match="multiples of 8"):
        ours.encode(x[:, :, :60])


def test_decoder_only_load(reference, ours) -> None:
    _, path = reference
    dec = load_vae(path, device="cpu", dtype=torch.float32)
    keys = set(dec.state_dict())
    assert keys and not any(k.startswith(("encoder.", "quant_conv.")) for k in keys)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in dec.state_dict().items())
    assert not dec.training
    with pytest.raises(RuntimeError, match="with_encoder=True"):
        dec.encode(torch.zeros(1, 3, 64, 64))


@pytest.mark.slow
def test_bf16_load_decodes_close_to_fp32(reference, ours) -> None:
    _, path = reference
    dec = load_vae(path, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in dec.parameters()} == {torch.bfloat16}
    z = torch.randn(1, 16, 6, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = dec.decode(z.bfloat16()).float()
        want = ours.decode(z)
    assert got.dtype == torch.float32 and (got - want).abs().mean().item() < 0.05


@pytest.mark.slow
def test_state_dict_3d_round_trip_through_diffusers(ours, tmp_path) -> None:
    # A VAE whose weights came from our 2D code (not from a 3D checkpoint), saved in diffusers' layout.
    torch.manual_seed(5)
    trained = QwenImageVAE(ours.config).eval()
    _randomise(trained, seed=6)
    save_vae(trained, tmp_path)
    ref = AutoencoderKLQwenImage.from_pretrained(tmp_path).eval()
    theirs = ref.state_dict()
    state3d = vae_state_dict_3d(trained)
    assert set(state3d) == set(theirs)
    assert all(state3d[k].shape == theirs[k].shape for k in theirs)

    z = torch.randn(2, 16, 6, 10, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = trained.decode(z)
        assert (_diffusers_decode(ref, z) - want).abs().max().item() < ATOL
        # Frames never mix: a 2-frame clip is frame 0 once, then frame 1 four times (two 2x time upsamplers).
        video = ref.decode(torch.stack([z, z.flip(0)], dim=2)).sample
        x = torch.rand(1, 3, 32, 40, generator=torch.Generator().manual_seed(8)) * 2 - 1
        enc_ref = ref.encode(x[:, :, None]).latent_dist.mean[:, :, 0]
        enc_ours = trained.encode(x)
    assert video.shape[2] == 5
    assert (video[:, :, 0] - want).abs().max().item() < ATOL
    second = trained.decode(z.flip(0))
    assert max((video[:, :, t] - second).abs().max().item() for t in range(1, 5)) < ATOL
    assert (enc_ref - enc_ours).abs().max().item() < ATOL

    reloaded = load_vae(tmp_path, device="cpu", dtype=torch.float32, with_encoder=True)
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in trained.state_dict().items())


def _copy_component(src: Path, dst: Path, drop: str | None = None) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    if drop is not None:
        del state[drop]
    save_file(state, str(dst / "diffusion_pytorch_model.safetensors"))
    return dst


def test_missing_key_is_named(reference, tmp_path) -> None:
    _, path = reference
    broken = _copy_component(path, tmp_path / "a", drop="decoder.up_blocks.1.resnets.0.conv1.weight")
    with pytest.raises(WeightsError, match=r"missing keys.*decoder\.up_blocks\.1\.resnets\.0\.conv1\.weight"):
        load_vae(broken)
    no_time = _copy_component(path, tmp_path / "b", drop="decoder.up_blocks.1.upsamplers.0.time_conv.weight")
    with pytest.raises(WeightsError, match=r"missing keys.*time_conv\.weight"):
        load_vae(no_time)
    # Encoder keys are only required when the encoder is asked for.
    enc = _copy_component(path, tmp_path / "c", drop="encoder.conv_in.weight")
    assert load_vae(enc).encoder is None
    with pytest.raises(WeightsError, match=r"encoder\.conv_in\.weight"):
        load_vae(enc, with_encoder=True)


def test_2d_weights_are_refused_with_the_key(reference, tmp_path) -> None:
    _, path = reference
    bad = _copy_component(path, tmp_path / "a")
    state = load_file(str(bad / "diffusion_pytorch_model.safetensors"))
    state["decoder.conv_in.weight"] = state["decoder.conv_in.weight"][:, :, -1].contiguous()
    save_file(state, str(bad / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(WeightsError, match=r"decoder\.conv_in\.weight: checkpoint \(128, 16, 3, 3\)"):
        load_vae(bad)


def test_pickle_only_dir_is_refused(reference, tmp_path) -> None:
    _, path = reference
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    torch.save({"decoder.conv_in.bias": torch.zeros(1)}, tmp_path / "diffusion_pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle"):
        load_vae(tmp_path)


def test_config_keys(reference, tmp_path) -> None:
    _, path = reference
    raw = json.loads((path / "config.json").read_text())
    cfg = VAEConfig.from_dict(raw)  # _class_name and _diffusers_version are metadata
    assert cfg.dim_mult == (1, 2, 4, 4) and cfg.spatial_compression == 8
    assert VAEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="'scaling_factor'"):
        VAEConfig.from_dict({**raw, "scaling_factor": 0.5})
    with pytest.raises(ValueError, match="latents_std has 3 entries"):
        VAEConfig.from_dict({**raw, "latents_std": [1.0, 1.0, 1.0]})
    (tmp_path / "config.json").write_text(json.dumps({**raw, "_class_name": "AutoencoderKLWan"}))
    with pytest.raises(WeightsError, match="AutoencoderKLWan"):
        load_vae(tmp_path)


def test_normalize_inverts_denormalize(ours) -> None:
    z = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(9))
    mean = torch.tensor(ours.config.latents_mean).view(1, 16, 1, 1)
    std = torch.tensor(ours.config.latents_std).view(1, 16, 1, 1)
    assert torch.allclose(ours.denormalize(z), z * std + mean)
    assert torch.allclose(ours.normalize(ours.denormalize(z)), z, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_f_normalize(dtype) -> None:
    """The norm is written as sum + rsqrt for speed; it must stay diffusers' F.normalize(x, dim=1)
    * sqrt(C) * gamma, including an all-zero pixel (zero out, no NaN) and half-precision input."""
    norm = RMSNorm(32, video_gamma=False)
    with torch.no_grad():
        norm.gamma.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(2)) * 40
    x[0, :, 3, 4] = 0.0
    x = x.to(dtype)
    expected = F.normalize(x.float(), dim=1).to(dtype) * (32**0.5) * norm.gamma
    got = norm(x)
    assert got.dtype == expected.dtype
    assert torch.isfinite(got).all()
    assert torch.equal(got[0, :, 3, 4], torch.zeros_like(got[0, :, 3, 4]))
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
