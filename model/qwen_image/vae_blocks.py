"""Building blocks of the Qwen-Image VAE, computed as a 2D (single image) network.

The checkpoint is a causal 3D video VAE. Every causal conv pads time with `2 * (k // 2)` zeros in
front and none behind, so for a single frame only the last temporal slice of each kernel ever
multiplies data: a 2D conv with `weight[:, :, -1]` computes the same thing. The temporal
resampling convs (`time_conv`) do not run at all for the first frame of a clip (the decoder marks
its cache "Rep" and the encoder only stores the frame), so these blocks do not hold them.

Module names mirror diffusers' `AutoencoderKLQwenImage` so that state-dict keys are diffusers'
keys; `model/qwen_image/vae.py` does the 5-D -> 4-D weight mapping. Shapes below: B batch, C channels,
H x W spatial size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ditfleet.model.qwen_image.vae_config import VAEConfig


class CausalConv2d(nn.Conv2d):
    """The single-frame slice of a causal `k x k x k` Conv3d: same spatial kernel, zero padding k // 2.

    The class marks which convs come from a 3D checkpoint (weight stored 5-D, temporal size
    `kernel_size[0]`), as opposed to the plain `nn.Conv2d` in resampling and attention, which
    diffusers already stores 4-D.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, padding=kernel_size // 2)

    @property
    def weight_shape_3d(self) -> tuple[int, ...]:
        o, i, kh, kw = self.weight.shape
        return (o, i, kh, kh, kw)  # cubic kernels: temporal size equals the spatial one


class RMSNorm(nn.Module):
    """Channel RMS norm: `normalize(x, dim=1) * sqrt(C) * gamma`, on (B, C, H, W).

    `video_gamma` says how the checkpoint stores gamma: (C, 1, 1, 1) for norms that diffusers
    applies to (B, C, T, H, W) tensors, (C, 1, 1) for the attention norm that runs per frame.
    Half-precision inputs are normalised in fp32 (the sum of squares overflows fp16).
    """

    def __init__(self, dim: int, video_gamma: bool) -> None:
        super().__init__()
        self.video_gamma = video_gamma
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            # The fp32 copy must die inside _unit_norm before the cast back: a local holding it
            # through the cast and the scaling raised the decode's peak memory by 15% in bf16.
            return _unit_norm(x.float()).to(x.dtype) * self.scale * self.gamma
        return _unit_norm(x) * self.scale * self.gamma


def _unit_norm(x: Tensor) -> Tensor:
    """x / max(|x|, 1e-12) over channels, like F.normalize(x, dim=1), written as a sum and an
    rsqrt: on CPU that runs forward + backward 2-3x faster than F.normalize's vector-norm kernel on
    NCHW tensors (bench/vae_norm.py), at the same peak memory."""
    return x * torch.rsqrt(x.pow(2).sum(dim=1, keepdim=True).clamp_min(1e-24))


class Resample(nn.Module):
    """2x spatial up- or downsampling; `mode` keeps diffusers' name (e.g. 'upsample3d').

    For a single frame the '3d' modes compute exactly what the '2d' ones do; the mode is kept
    because the checkpoint holds a `time_conv` for them, with shape `time_conv_shape_3d`.
    """

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"Resample mode {mode!r} is not one of {self.MODES}.")
        self.mode = mode
        if mode.startswith("upsample"):
            # Upsample has no parameters; index 1 keeps the conv at diffusers' key `resample.1`.
            self.resample = nn.Sequential(
                nn.Upsample(scale_factor=2.0, mode="nearest-exact"), nn.Conv2d(dim, dim // 2, 3, padding=1)
            )
        else:
            # Pad right/bottom only, then a stride-2 valid conv: (H, W) -> (H/2, W/2) for even sizes.
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        self.time_conv_shape_3d: tuple[int, ...] | None = None
        if mode == "upsample3d":
            self.time_conv_shape_3d = (dim * 2, dim, 3, 1, 1)
        elif mode == "downsample3d":
            self.time_conv_shape_3d = (dim, dim, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.resample(x)  # (B, C, H, W) -> (B, C/2, 2H, 2W) up, (B, C, H/2, W/2) down


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim, video_gamma=True)
        self.conv1 = CausalConv2d(in_dim, out_dim, 3)
        self.norm2 = RMSNorm(out_dim, video_gamma=True)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv2d(out_dim, out_dim, 3)
        self.conv_shortcut: nn.Module = (
            CausalConv2d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_shortcut(x)  # (B, out, H, W)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(self.dropout(F.silu(self.norm2(x))))
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each image."""

    # q/k/v handed to SDPA dense (True) or as views of the conv output (False); None: dense on
    # CUDA only. On the CPU the views keep the images byte for byte what they were (the dense
    # layout moves SDPA to another CPU kernel, which rounds differently).
    dense_qkv: bool | None = None

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, video_gamma=False)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x))  # (B, 3C, H, W), channels [q | k | v]
        dense = x.is_cuda if self.dense_qkv is None else self.dense_qkv
        if dense:
            # q, k, v as dense (B, 1, HW, C) tensors, channels last: the layout SDPA's fused
            # kernels take. The views below have stride H*W along C, which leaves only the math
            # path on CUDA (an (HW, HW) score matrix: gigabytes at 1328x1328). One copy of the three.
            qkv = qkv.reshape(b, 3, c, h * w).transpose(-1, -2).contiguous()  # (B, 3, HW, C)
            q, k, v = qkv.unsqueeze(2).unbind(1)  # each (B, 1, HW, C)
        else:
            qkv = qkv.reshape(b, 1, 3 * c, h * w).transpose(-1, -2)  # (B, 1, HW, 3C)
            q, k, v = qkv.chunk(3, dim=-1)  # each (B, 1, HW, C)
        del qkv
        out = F.scaled_dot_product_attention(q, k, v)  # (B, 1, HW, C)
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj(out)


class MidBlock(nn.Module):
    """resnet -> attention -> resnet at the lowest resolution."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout), ResidualBlock(dim, dim, dropout)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            x = resnet(attn(x))
        return x


class UpBlock(nn.Module):
    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, upsample_mode: str | None
    ) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList([ResidualBlock(i, o, dropout) for i, o in zip(dims[:-1], dims[1:])])
        self.upsamplers = nn.ModuleList([Resample(out_dim, upsample_mode)]) if upsample_mode else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Encoder(nn.Module):
    """(B, in_ch, H, W) -> (B, 2 * z_dim, H / 2**n, W / 2**n), n = len(dim_mult) - 1.

    `down_blocks` is one flat list (resnets, attention where `attn_scales` asks, resamplers), as
    in diffusers, so that the indices in the keys match.
    """

    def __init__(self, c: VAEConfig) -> None:
        super().__init__()
        dims = [c.base_dim * u for u in (1, *c.dim_mult)]
        self.conv_in = CausalConv2d(c.input_channels, dims[0], 3)
        blocks: list[nn.Module] = []
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(c.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, c.dropout))
                if scale in c.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(c.dim_mult) - 1:
                blocks.append(
                    Resample(out_dim, "downsample3d" if c.temperal_downsample[i] else "downsample2d")
                )
                scale /= 2.0
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1], c.dropout)
        self.norm_out = RMSNorm(dims[-1], video_gamma=True)
        self.conv_out = CausalConv2d(dims[-1], 2 * c.z_dim, 3)  # the posterior's mean and logvar

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class Decoder(nn.Module):
    """(B, z_dim, h, w) -> (B, input_channels, h * 2**n, w * 2**n), n = len(dim_mult) - 1; not clamped."""

    def __init__(self, c: VAEConfig) -> None:
        super().__init__()
        dims = [c.base_dim * u for u in (c.dim_mult[-1], *c.dim_mult[::-1])]
        temporal_upsample = c.temperal_downsample[::-1]
        self.conv_in = CausalConv2d(c.z_dim, dims[0], 3)
        self.mid_block = MidBlock(dims[0], c.dropout)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            # Every block after the first follows an upsampler, whose conv halves the channels.
            in_dim = in_dim // 2 if i > 0 else in_dim
            mode = None
            if i != len(c.dim_mult) - 1:
                mode = "upsample3d" if temporal_upsample[i] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, c.num_res_blocks, c.dropout, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1], video_gamma=True)
        self.conv_out = CausalConv2d(dims[-1], c.input_channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(x))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))
