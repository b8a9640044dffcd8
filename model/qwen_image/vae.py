"""The Qwen-Image VAE as a 2D image model, loading diffusers' `AutoencoderKLQwenImage` weights.

The checkpoint is a causal 3D video VAE; for one frame only the last temporal slice of each conv
kernel sees data (see `model/qwen_image/vae_blocks.py`), so the 2D model computes what diffusers computes
for `z[:, :, None]` with a third of the conv weights and none of the per-frame cache logic.
`load_vae` slices the 5-D weights; `vae_state_dict_3d` writes them back in the diffusers layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ditfleet.model.loading.checkpoint import Checkpoint
from ditfleet.model.loading.weights import (
    WeightsError,
    assign_state_dict,
    on_meta,
    read_config,
    read_state_dict,
)
from ditfleet.model.qwen_image.vae_blocks import CausalConv2d, Decoder, Encoder, Resample, RMSNorm
from ditfleet.model.qwen_image.vae_config import DIFFUSERS_CLASS, VAEConfig  # noqa: F401 - re-exported

ENCODER_PREFIXES = ("encoder.", "quant_conv.")


class QwenImageVAE(nn.Module):
    """Image VAE: (B, 3, H, W) in [-1, 1] <-> (B, z_dim, H/8, W/8) latents (for 3 down levels).

    With `with_encoder=False` the module holds only `decoder` and `post_quant_conv`.
    """

    def __init__(self, config: VAEConfig, with_encoder: bool = True) -> None:
        super().__init__()
        self.config = config
        self.encoder: Encoder | None = None
        self.quant_conv: CausalConv2d | None = None
        if with_encoder:
            self.encoder = Encoder(config)
            self.quant_conv = CausalConv2d(config.z_dim * 2, config.z_dim * 2, 1)
        self.post_quant_conv = CausalConv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)

    def decode(self, z: Tensor) -> Tensor:
        """(B, z_dim, h, w) de-normalised latents -> (B, 3, s*h, s*w) image clamped to [-1, 1]."""
        if z.ndim != 4 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"decode expects (B, {self.config.z_dim}, h, w) latents, got {tuple(z.shape)}.")
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)

    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 3, H, W) in [-1, 1] -> posterior (mean, logvar), each (B, z_dim, H/s, W/s), not normalised.

        logvar is clamped to [-30, 20] like diffusers' DiagonalGaussianDistribution.
        """
        if self.encoder is None or self.quant_conv is None:
            raise RuntimeError(
                "This VAE was loaded without its encoder; use load_vae(..., with_encoder=True)."
            )
        s = self.config.spatial_compression
        if x.ndim != 4 or x.shape[1] != self.config.input_channels or x.shape[2] % s or x.shape[3] % s:
            raise ValueError(
                f"encode expects (B, {self.config.input_channels}, H, W) with H, W multiples of {s}, "
                f"got {tuple(x.shape)}."
            )
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, x: Tensor) -> Tensor:
        """(B, 3, H, W) in [-1, 1] -> posterior mean (B, z_dim, H/s, W/s), not normalised."""
        return self.encode_moments(x)[0]

    def _stats(self, z: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, self.config.z_dim, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=z.device).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=z.device).view(shape)
        return mean, std

    def normalize(self, z: Tensor) -> Tensor:
        """Per channel (z - mean) / std, computed in fp32, returned in z's dtype."""
        mean, std = self._stats(z)
        return ((z.float() - mean) / std).to(z.dtype)

    def denormalize(self, z: Tensor) -> Tensor:
        """Per channel z * std + mean, computed in fp32, returned in z's dtype."""
        mean, std = self._stats(z)
        return (z.float() * std + mean).to(z.dtype)


# --- the diffusers 3D layout <-> our 2D layout -------------------------------------------------


def _layout(
    vae: QwenImageVAE,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """Keys whose checkpoint shape differs from ours: causal conv weights (5-D), video norm gammas
    (C, 1, 1, 1), and the checkpoint-only `time_conv` tensors; each with its 3D shape."""
    convs: dict[str, tuple[int, ...]] = {}
    gammas: dict[str, tuple[int, ...]] = {}
    time_convs: dict[str, tuple[int, ...]] = {}
    for name, m in vae.named_modules():
        if isinstance(m, CausalConv2d):
            convs[f"{name}.weight"] = m.weight_shape_3d
        elif isinstance(m, RMSNorm) and m.video_gamma:
            gammas[f"{name}.gamma"] = (m.gamma.shape[0], 1, 1, 1)
        elif isinstance(m, Resample) and m.time_conv_shape_3d is not None:
            time_convs[f"{name}.time_conv.weight"] = m.time_conv_shape_3d
            time_convs[f"{name}.time_conv.bias"] = m.time_conv_shape_3d[:1]
    return convs, gammas, time_convs


def state_dict_from_3d(vae: QwenImageVAE, state: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """Map a diffusers checkpoint onto `vae`'s keys: take the last temporal slice of each causal conv,
    flatten video gammas, check and drop `time_conv`s. Keys `vae` does not hold pass through."""
    convs, gammas, time_convs = _layout(vae)
    missing = sorted(k for k in time_convs if k not in state)
    if missing:
        raise WeightsError(
            f"{where}: missing keys ({len(missing)}): {missing[:20]}. The config's temperal_downsample asks for "
            "these temporal convs; check that the config.json belongs to these weights."
        )
    out, bad = {}, []
    for k, v in state.items():
        expect = convs.get(k) or gammas.get(k) or time_convs.get(k)
        if expect is not None and tuple(v.shape) != expect:
            bad.append(f"{k}: checkpoint {tuple(v.shape)} vs expected 3D layout {expect}")
        elif k in convs:
            out[k] = v[:, :, -1].contiguous()  # the only temporal slice that meets data for one frame
        elif k in gammas:
            out[k] = v.reshape(v.shape[0], 1, 1)
        elif k not in time_convs:  # time_conv never runs for a single frame
            out[k] = v
    if bad:
        raise WeightsError(
            f"{where}: {len(bad)} tensors are not in diffusers' AutoencoderKLQwenImage layout, e.g. {bad[:5]}. "
            "Check that the config.json belongs to these weights."
        )
    return out


def vae_state_dict_3d(vae: QwenImageVAE) -> dict[str, Tensor]:
    """Our weights in diffusers' 3D layout, so `AutoencoderKLQwenImage` decodes an image exactly as we do.

    Each causal conv kernel goes to the last temporal slice with zeros elsewhere, so frames do not
    mix; each `time_conv` is an identity on its last slice (the upsampler repeats a frame, the
    downsampler keeps one). A video decoded by diffusers is then every latent frame decoded on its
    own, repeated in time. A decoder-only `vae` gives decoder keys only.
    """
    convs, gammas, time_convs = _layout(vae)
    out = {}
    for k, v in vae.state_dict().items():
        v = v.detach()
        if k in convs:
            w = v.new_zeros(convs[k])
            w[:, :, -1] = v
            out[k] = w
        elif k in gammas:
            out[k] = v.reshape(gammas[k]).clone()
        else:
            out[k] = v.clone()
    ref = next(iter(vae.parameters()))
    for k, shape in time_convs.items():
        if k.endswith(".bias"):
            out[k] = ref.new_zeros(shape)
            continue
        w = ref.new_zeros(shape)
        c = shape[1]
        for half in range(shape[0] // c):  # upsample: 2 halves, each one output frame
            w[half * c : (half + 1) * c, :, -1, 0, 0] = torch.eye(c, dtype=w.dtype, device=w.device)
        out[k] = w
    return out


def save_vae(vae: QwenImageVAE, out_dir: Path) -> None:
    """Write `config.json` + `diffusion_pytorch_model.safetensors` in the diffusers layout."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(vae.config.to_dict(), indent=2, sort_keys=True))
    state = {k: v.contiguous().cpu() for k, v in vae_state_dict_3d(vae).items()}
    save_file(state, str(out_dir / "diffusion_pytorch_model.safetensors"))


def load_vae(
    component_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    with_encoder: bool = False,
) -> QwenImageVAE:
    """Load a diffusers `vae/` folder (config.json + safetensors) into a 2D `QwenImageVAE`, in eval mode.

    Built on the meta device and filled strictly: a missing, unexpected or misshapen key is a
    `WeightsError` naming it. Without the encoder, its keys in the checkpoint are skipped.
    """
    component_dir = Path(component_dir)
    cfg_path = component_dir / "config.json"
    raw = read_config(component_dir)
    cls_name = raw.get("_class_name", DIFFUSERS_CLASS)
    if cls_name != DIFFUSERS_CLASS:
        raise WeightsError(
            f"{cfg_path}: _class_name is {cls_name!r}; expected {DIFFUSERS_CLASS!r} (the Qwen-Image VAE)."
        )
    config = VAEConfig.from_dict(raw, source=str(cfg_path))
    with on_meta():
        vae = QwenImageVAE(config, with_encoder=with_encoder)
    Checkpoint(component_dir)  # a missing or truncated file is named before anything is read
    state = state_dict_from_3d(vae, read_state_dict(component_dir), where=str(component_dir))
    ignore = () if with_encoder else ENCODER_PREFIXES
    assign_state_dict(
        vae, state, where=str(component_dir), dtype=dtype, device=device, ignore_prefixes=ignore
    )
    return vae.eval()
