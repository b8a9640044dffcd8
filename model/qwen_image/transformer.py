"""The Qwen-Image MMDiT: dual-stream blocks with joint attention over [text, image].

Module names mirror diffusers' `QwenImageTransformer2DModel` so its safetensors load key for key
(`transformer_blocks.N.img_mod.1`, `attn.to_q`, `attn.add_q_proj`, `img_mlp.net.0.proj`, ...).

Shapes: B batch, N image tokens (latent grid h*w after 2x2 packing), L text tokens, D = heads x
head_dim, C = 64 packed latent channels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ditfleet.model.qwen_image.attention import AttentionStats, TextPadding, joint_attention
from ditfleet.model.qwen_image.modulation_cache import ModulationCache, ModulationKey, make_key
from ditfleet.model.qwen_image.rope import RotaryTables, Rotation, apply_rotary, image_shapes
from ditfleet.model.qwen_image.transformer_config import TransformerConfig  # noqa: F401 - re-exported
from ditfleet.model.settings import DEFAULT_PIPELINE


class BlockRunner(Protocol):
    """What runs a forward's blocks in the transformer's place (a step cache's rows for one
    call, model.generation.step_cache), through `run_blocks` and `first_block_input`."""

    def run(
        self, transformer: QwenImageTransformer, img: torch.Tensor, txt: torch.Tensor, inputs: BlockInputs
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast to the weight dtype before the scale (as diffusers does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(self.weight.dtype) * self.weight


class TimestepEmbedder(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def sinusoidal_embedding(t: torch.Tensor, channels: int = 256, scale: float = 1000.0) -> torch.Tensor:
    """t (B,) in [0, 1] -> (B, channels) fp32, [cos | sin].

    The pipeline divides the scheduler's t in [0, 1000] by 1000 exactly once; `scale` undoes it
    here (the diffusers convention the weights were trained with).
    """
    half = channels // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    # t * freqs first, then the scale: the reference's order, so the fp32 arguments match bit for bit.
    args = scale * (t[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int, use_additional_t_cond: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(256, dim)
        self.use_additional_t_cond = use_additional_t_cond
        if use_additional_t_cond:
            self.addition_t_embedding = nn.Embedding(2, dim)

    def forward(
        self, timestep: torch.Tensor, dtype: torch.dtype, additional_t_cond: torch.Tensor | None
    ) -> torch.Tensor:
        temb = self.timestep_embedder(sinusoidal_embedding(timestep).to(dtype))  # (B, D)
        if self.use_additional_t_cond:
            if additional_t_cond is None:
                raise ValueError("this transformer has use_additional_t_cond: pass additional_t_cond")
            temb = temb + self.addition_t_embedding(additional_t_cond).to(dtype)
        return temb


class GeluMLP(nn.Module):
    """FeedForward with tanh-GELU; `net.0.proj`, `net.2` as in diffusers."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, dim * mult)
        self.net = nn.ModuleList([proj, nn.Dropout(0.0), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Module attributes read as `Tensor | Module` to mypy; `proj` is the Linear set in __init__
        # (or the quantized layer that replaced it).
        proj = cast(nn.Module, self.net[0].proj)
        return self.net[2](F.gelu(proj(x), approximate="tanh"))


# The image stream's fused q/k/v projection (JointAttention.fuse_qkv), kept out of the module's
# registry: it holds no weights of its own (the three projections' parameters are views of its),
# so the state dict, the parameter count and the memory plan stay the checkpoint's.
_FUSED = "_img_qkv"


class JointAttention(nn.Module):
    """Attention over [image, text] with per-head RMS q/k norms and interleaved RoPE.

    Split in two tensor functions around the attention kernel, so that a compiler can take the
    elementwise-heavy parts while the kernel choice (`model.qwen_image.attention`) stays a runtime decision.
    """

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(dim, dim)

    def fuse_qkv(self) -> bool:
        """The image stream's q, k and v as one batched GEMM (one launch instead of three) over
        a (3D, D) weight whose row blocks the three Linears' weights become views of, so their
        names, state dict and in-place updates (a LoRA merged later) all still hold and no weight
        is held twice. Only where the three are plain Linears of one dtype and device (an FP8
        layer keeps its own GEMMs). Called by the loader once the weights are in; `.to()` and
        other conversions fuse again. Returns whether fused.

        The text stream keeps three GEMMs: fused, its length (dynamic, unlike the image's N)
        would meet the same compiler guards as the batch (see _image_qkv), for GEMMs of L x D,
        small beside the image's N x D."""
        self.__dict__[_FUSED] = _fuse(self.to_q, self.to_k, self.to_v)
        return self.qkv_fused

    def unfuse_qkv(self) -> None:
        """Back to three GEMMs, each Linear with a weight of its own (a copy): the before of a
        side-by-side measurement (bench/, the self-test)."""
        self.__dict__.pop(_FUSED, None)
        for m in (self.to_q, self.to_k, self.to_v):
            for key, p in list(m.named_parameters(recurse=False)):
                setattr(m, key, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))

    @property
    def qkv_fused(self) -> bool:
        return self.__dict__.get(_FUSED) is not None

    def _apply(self, fn, recurse=True):
        # A conversion (.to, .half, ...) gives each parameter its own new storage: the views
        # would no longer be of the fused weight, so fuse again from the converted ones.
        was = self.qkv_fused
        self.__dict__.pop(_FUSED, None)
        out = super()._apply(fn, recurse)
        if was:
            self.fuse_qkv()
        return out

    def _image_qkv(self, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v (B, N, H, hd) of the image stream: one batched GEMM over the fused weight's
        three (D, D) blocks, or three GEMMs."""
        split = (-1, self.head_dim)
        fused = self.__dict__.get(_FUSED)
        if fused is None:
            return tuple(layer(img).unflatten(-1, split) for layer in (self.to_q, self.to_k, self.to_v))
        B, N, D = img.shape
        # (3, B*N, D): q, k and v each dense. One (B*N, 3D) GEMM would give strided column blocks,
        # and a view of those (the rotary's pairs) makes the compiler guard on the batch size, a
        # recompile at batch 1; the batched GEMM's blocks are the same products (bit for bit on
        # the CPU) in one launch.
        out = torch.baddbmm(
            fused.bias.view(3, 1, D),
            img.reshape(1, B * N, D).expand(3, -1, -1),
            fused.weight.view(3, D, D).mT,
        )
        return tuple(t.view(B, N, *split) for t in out.unbind(0))

    def qkv(
        self,
        img: torch.Tensor,  # (B, N, D), normed and modulated
        txt: torch.Tensor,  # (B, L, D)
        rope: tuple[Rotation, Rotation],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, N + L, hd): image tokens first, then text."""
        img_rot, txt_rot = rope
        split = (-1, self.head_dim)
        img_q, img_k, img_v = self._image_qkv(img)
        txt_q, txt_k, txt_v = (
            layer(txt).unflatten(-1, split) for layer in (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        )
        q = torch.cat(
            [_rms_rotary(img_q, self.norm_q, img_rot), _rms_rotary(txt_q, self.norm_added_q, txt_rot)], dim=1
        )  # (B, N + L, H, hd)
        k = torch.cat(
            [_rms_rotary(img_k, self.norm_k, img_rot), _rms_rotary(txt_k, self.norm_added_k, txt_rot)], dim=1
        )
        v = torch.cat([img_v, txt_v], dim=1)
        return q.transpose(1, 2), k.transpose(1, 2), v.to(q.dtype).transpose(1, 2)

    def project_out(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-stream attention outputs (B, N, D), (B, L, D) -> their output projections."""
        return self.to_out[0](img), self.to_add_out(txt)


def _fuse(*linears: nn.Module) -> nn.Linear | None:
    """One Linear computing `linears` side by side (outputs concatenated), their weights and
    biases made views of its; None unless all are plain Linears with biases, of one dtype and
    device, not on the meta device."""
    # nn.Linear or a subclass that only changes how its forward runs (compile.cpu_linear's
    # oneDNN swap); an FP8 layer is no Linear
    if not all(isinstance(m, nn.Linear) for m in linears):
        return None
    layers = cast("tuple[nn.Linear, ...]", linears)
    weights, biases = [m.weight for m in layers], [m.bias for m in layers]
    if any(b is None for b in biases) or weights[0].is_meta:
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    with torch.no_grad():
        weight, bias = torch.cat(weights), torch.cat(cast("list[torch.Tensor]", biases))
    fused = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in layers:
        n = m.weight.shape[0]
        grad = m.weight.requires_grad
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=grad)
        m.bias = nn.Parameter(bias[start : start + n], requires_grad=grad)
        start += n
    return fused


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """Attention output (B, H, N + L, hd) -> (B, N + L, D), contiguous: a view of SDPA's output
    where its memory is (B, S, H, hd) (the fused kernels'), else one copy. The image and text
    streams are split inside the compiled attention_outputs, not copied out here: a compiled
    consumer sees one dense layout whatever the batch, text length or kernel, and no clone
    runs between the attention kernel and the output projections."""
    return out.transpose(1, 2).flatten(2)


def _rms_rotary(x: torch.Tensor, norm: RMSNorm, rotation: Rotation) -> torch.Tensor:
    """Per-head RMS norm, then RoPE, both in fp32 with one cast back: x (B, S, H, hd).

    Same math as RMSNorm then apply_rotary; it skips their cast to the weight dtype and back.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    return apply_rotary(normed, rotation).to(x.dtype)


def _norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine, then x * (1 + scale) + shift; x (B, S, D), shift/scale (B or 1, D).

    With one modulation row for the whole batch (one timestep per step, the usual case) the
    modulation is LayerNorm's own affine: one kernel instead of three.
    """
    D = x.shape[-1]
    if shift.shape[0] == 1:
        return F.layer_norm(x, (D,), weight=1 + scale[0], bias=shift[0], eps=eps)
    return torch.addcmul(shift[:, None], F.layer_norm(x, (D,), eps=eps), 1 + scale[:, None])


def _gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y in one kernel; gate (B or 1, D)."""
    return torch.addcmul(x, gate[:, None], y)


@dataclass(frozen=True)
class SplitModulation:
    """The image stream's modulation when its condition tokens are modulated apart (Qwen-Image-Edit
    2511's `zero_cond_t`): the target's tokens [0, split) by `target` (this step's timestep), the
    sources' tokens [split, N) by `cond` (timestep 0); each (B or 1, 6D)."""

    target: torch.Tensor
    cond: torch.Tensor
    split: int


ImageModulation = torch.Tensor | SplitModulation


def _image_norm_modulate(x: torch.Tensor, mod: ImageModulation, k: int, eps: float) -> torch.Tensor:
    """_norm_modulate of the image stream with chunks k, k + 1 (shift, scale) of its modulation."""
    if isinstance(mod, SplitModulation):
        n, t, c = mod.split, mod.target.chunk(6, dim=-1), mod.cond.chunk(6, dim=-1)
        parts = (_norm_modulate(x[:, :n], t[k], t[k + 1], eps), _norm_modulate(x[:, n:], c[k], c[k + 1], eps))
        return torch.cat(parts, dim=1)
    shift, scale = mod.chunk(6, dim=-1)[k : k + 2]
    return _norm_modulate(x, shift, scale, eps)


def _image_gated_residual(x: torch.Tensor, mod: ImageModulation, k: int, y: torch.Tensor) -> torch.Tensor:
    """_gated_residual of the image stream with chunk k (a gate) of its modulation."""
    if isinstance(mod, SplitModulation):
        n = mod.split
        target = _gated_residual(x[:, :n], mod.target.chunk(6, dim=-1)[k], y[:, :n])
        return torch.cat([target, _gated_residual(x[:, n:], mod.cond.chunk(6, dim=-1)[k], y[:, n:])], dim=1)
    return _gated_residual(x, mod.chunk(6, dim=-1)[k], y)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_mlp = GeluMLP(dim)
        self.txt_mlp = GeluMLP(dim)
        self.eps = 1e-6

    def modulation(
        self, temb: torch.Tensor, key: ModulationKey | None, cache: ModulationCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(img_mod, txt_mod), each (B, 6D): [shift1, scale1, gate1, shift2, scale2, gate2]."""
        if cache is not None:
            hit = cache.lookup(key, self.index)
            if hit is not None:
                return hit
        value = (self.img_mod(temb), self.txt_mod(temb))  # img_mod.1 / txt_mod.1 called as modules
        if cache is not None:
            cache.store(key, self.index, value)
        return value

    def forward(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        temb: torch.Tensor,  # (B or 1, D)
        padding: TextPadding,
        rope: tuple[Rotation, Rotation],
        stats: AttentionStats | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod, txt_mod = self.modulation(temb, None, None)
        return self.body(img, txt, img_mod, txt_mod, padding, rope, stats)

    def body(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        img_mod: ImageModulation,  # (B or 1, 6D), or split at the sources (SplitModulation)
        txt_mod: torch.Tensor,  # (B or 1, 6D)
        padding: TextPadding,
        rope: tuple[Rotation, Rotation],
        stats: AttentionStats | None = None,
        img_in: torch.Tensor | None = None,  # modulated_input(img, img_mod) when already made
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention and MLP given the modulation: `attention_inputs` and `attention_outputs`
        are pure tensor functions (what a compiler takes) around the attention kernel, which
        depends on the batch's padding."""
        if img_in is None:
            q, k, v = self.attention_inputs(img, txt, img_mod, txt_mod, rope)
        else:  # TeaCache's block 0: its signal is this input, made once (model.generation.step_cache)
            q, k, v = self.modulated_attention_inputs(img_in, txt, txt_mod, rope)
            del img_in  # freed before the attention, as the memory plan counts it
        attn = joint_attention(q, k, v, padding, stats)  # (B, H, N + L, hd)
        return self.attention_outputs(img, txt, merge_heads(attn), img_mod, txt_mod)

    def modulated_input(self, img: torch.Tensor, img_mod: ImageModulation) -> torch.Tensor:
        """The image stream as the attention sees it, LayerNorm then the first shift and scale,
        (B, N, D): block 0's is TeaCache's signal of how much a step changes (model.generation.step_cache)."""
        return _image_norm_modulate(img, img_mod, 0, self.eps)

    def attention_inputs(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        img_mod: ImageModulation,  # (B or 1, 6D), or split at the sources (SplitModulation)
        txt_mod: torch.Tensor,  # (B or 1, 6D)
        rope: tuple[Rotation, Rotation],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LayerNorm + modulate of both streams, q/k/v projections, q/k RMS norm + RoPE:
        (B, H, N + L, hd) each. The compiled region (model.family): the image's norm and
        modulate fuse with the projections."""
        return self.modulated_attention_inputs(self.modulated_input(img, img_mod), txt, txt_mod, rope)

    def modulated_attention_inputs(
        self,
        img_in: torch.Tensor,  # (B, N, D), modulated_input(img, img_mod)
        txt: torch.Tensor,  # (B, L, D)
        txt_mod: torch.Tensor,  # (B or 1, 6D)
        rope: tuple[Rotation, Rotation],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """attention_inputs from the image stream already normed and modulated."""
        t_sh1, t_sc1 = txt_mod.chunk(6, dim=-1)[:2]
        txt_in = _norm_modulate(txt, t_sh1, t_sc1, self.eps)
        return self.attn.qkv(img_in, txt_in, rope)

    def attention_outputs(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        joint_attn: torch.Tensor,  # (B, N + L, D) attention output (merge_heads), before its projections
        img_mod: ImageModulation,  # (B or 1, 6D), or split at the sources (SplitModulation)
        txt_mod: torch.Tensor,  # (B or 1, 6D)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projections, gated residuals, LayerNorm + modulate, MLPs: new (img, txt)."""
        _, _, t_g1, t_sh2, t_sc2, t_g2 = txt_mod.chunk(6, dim=-1)
        N = img.shape[1]
        # views, no copy in eager; split by both lengths, so the text slice's length is the text's
        # own (a bare [:, N:] is a min/max expression Inductor's FP8 lowering fails on)
        img_attn, txt_attn = joint_attn.split([N, txt.shape[1]], dim=1)
        if torch.compiler.is_compiling():
            # A GEMM of a strided slice makes the compiler guard on the batch or text length
            # being 1 (a recompile): inside the graph the slices are dense copies, which Inductor
            # computes in the kernel that reads them where it can (an FP8 layer's quantization).
            dense = torch.contiguous_format
            img_attn, txt_attn = img_attn.clone(memory_format=dense), txt_attn.clone(memory_format=dense)
        img_attn, txt_attn = self.attn.project_out(img_attn, txt_attn)
        img = _image_gated_residual(img, img_mod, 2, img_attn)
        txt = _gated_residual(txt, t_g1, txt_attn)
        img = _image_gated_residual(
            img, img_mod, 5, self.img_mlp(_image_norm_modulate(img, img_mod, 3, self.eps))
        )
        txt = _gated_residual(txt, t_g2, self.txt_mlp(_norm_modulate(txt, t_sh2, t_sc2, self.eps)))
        if img.dtype == torch.float16:  # keep fp16 activations finite, as the reference does
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


class OutputNorm(nn.Module):
    """AdaLN-continuous: LayerNorm, then (1 + scale) and shift from Linear(SiLU(temb)); scale first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(x.dtype)).chunk(2, dim=-1)
        return _norm_modulate(x, shift, scale, 1e-6)


class QwenImageTransformer(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        modulation_cache: str = DEFAULT_PIPELINE.modulation_cache,
        padded_attention: str = "split",
    ) -> None:
        super().__init__()
        self.config = config
        # How a batch with padded prompts attends (see model.qwen_image.attention); "mask" is the reference.
        self.padded_attention = padded_attention
        self.attention_stats = AttentionStats()
        D = config.inner_dim
        self.rope = RotaryTables(config.axes_dims_rope)
        self.time_text_embed = TimeTextEmbed(D, config.use_additional_t_cond)
        self.txt_norm = RMSNorm(config.joint_attention_dim)
        self.img_in = nn.Linear(config.in_channels, D)
        self.txt_in = nn.Linear(config.joint_attention_dim, D)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(D, config.num_attention_heads, config.attention_head_dim, i)
            for i in range(config.num_layers)
        )
        self.norm_out = OutputNorm(D)
        out_channels = config.out_channels or config.in_channels
        self.proj_out = nn.Linear(D, config.patch_size**2 * out_channels)
        self.modulation_cache = ModulationCache(config.num_layers, modulation_cache)

    # Where it computes and in what dtype (model.generation.components.Denoiser): img_in's, a
    # Linear every quantization keeps in the load dtype (model.qwen_image.fp8).
    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, N, C) packed latents
        encoder_hidden_states: torch.Tensor,  # (B, L, joint_attention_dim)
        encoder_hidden_states_mask: torch.Tensor | None,  # (B, L), 1 = real token
        timestep: torch.Tensor,  # (B,) or (1,), scheduler t / 1000, in [0, 1]
        img_shapes: list,  # [(frames, h, w)] or [[(frames, h, w), *sources]] per sample, in packed tokens
        additional_t_cond: torch.Tensor | None = None,
        step_cache: BlockRunner | None = None,
    ) -> torch.Tensor:
        """Velocity prediction (B, N, patch^2 * out_channels) of the target's N tokens.

        An edit model's hidden_states are the target's packed latents then each source's
        (B, N + S, C), and img_shapes each sample's grids in that order (the target's first,
        `prepare_inputs`); the sources are attended to and never predicted (model.qwen_image.edit).

        step_cache: the rows' state when a step cache (model.generation.step_cache) serves this call; it
        calls `run_blocks` for the blocks and rows it computes. None: every block computes."""
        img = self.img_in(hidden_states)
        dtype, device = img.dtype, img.device
        mod_key = make_key(self, timestep, additional_t_cond, dtype, device)
        temb = self.time_text_embed(timestep.to(dtype), dtype, additional_t_cond)  # (B, D)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        (B, N), L = img.shape[:2], txt.shape[1]
        padding = TextPadding.build(encoder_hidden_states_mask, B, L, N, self.padded_attention)
        grids = batch_grids(img_shapes)
        target = grids[0][0] * grids[0][1] * grids[0][2]
        if sum(f * h * w for f, h, w in grids) != N:
            raise ValueError(f"img_shapes {list(grids)} hold {N} image tokens? hidden_states has {N}")
        rope = self.rope.tables(grids, L, device)
        cond_temb = None
        if self.config.zero_cond_t and target != N:  # 2511: the sources as if at t = 0
            cond_temb = self.time_text_embed(torch.zeros_like(timestep).to(dtype), dtype, additional_t_cond)
        inputs = BlockInputs(temb, padding, rope, mod_key, encoder_hidden_states_mask, cond_temb, target)
        if step_cache is not None:
            img = step_cache.run(self, img, txt, inputs)
        else:
            img, _ = self.run_blocks(img, txt, inputs)
        if target != N:  # an edit model's source tokens: only the target's are predicted
            img = img[:, :target]
        return self.proj_out(self.norm_out(img, temb))

    def fuse_qkv(self, on: bool = True) -> int:
        """Every block's image q/k/v as one GEMM (JointAttention.fuse_qkv), or with
        `on=False` back to three; returns the blocks fused."""
        fused = 0
        for block in cast("Iterable[TransformerBlock]", self.transformer_blocks):
            if on:
                fused += block.attn.fuse_qkv()
            else:
                block.attn.unfuse_qkv()
        return fused

    @torch.no_grad()
    def fill_modulation_table(self, timesteps: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
        """Compute and keep every block's modulation for each of `timesteps` (a schedule's
        timestep tensors, each (1,), as the pipeline's TimestepBank hands them to `forward`), so
        that no forward of that schedule computes any: the 'table' mode filled once, at warm-up.
        Each step is computed exactly as `forward` computes it (its own temb, one row per
        projection), so the values are those of per-step modulation bit for bit; one batched GEMM
        over all steps rounds differently (docs/performance.md "The modulation table"). Returns
        the entries filled; 0 where the mode on this device is not 'table' or caching is off."""
        device = self.img_in.weight.device
        if self.modulation_cache.mode_on(device.type) != "table":
            return 0
        filled = 0
        for t in timesteps:
            key = make_key(self, t, None, dtype, device)
            if key is None:
                return filled
            temb = self.time_text_embed(t.to(dtype), dtype, None)
            for block in cast("Iterable[TransformerBlock]", self.transformer_blocks):
                block.modulation(temb, key, self.modulation_cache)  # a miss computes and stores
                filled += 1
        return filled

    def first_block_input(self, img: torch.Tensor, inputs: BlockInputs) -> BlockStart:
        """Block 0's modulation and the image stream as its attention sees it (TeaCache's
        signal); `run_blocks(start=...)` uses both instead of computing them again."""
        block = cast(TransformerBlock, self.transformer_blocks[0])  # ModuleList items read as Module
        own, txt_mod = block.modulation(inputs.temb, inputs.mod_key, self.modulation_cache)
        img_mod = inputs.image_modulation(block, own)
        return BlockStart(img_mod, txt_mod, block.modulated_input(img, img_mod))

    def run_blocks(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        inputs: BlockInputs,
        blocks: slice = slice(None),
        rows: list[int] | None = None,
        start: BlockStart | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(img, txt) after `blocks` (all by default), for the batch rows `rows` only (None: all):
        a subset gets its own text padding and modulation rows, so a row's result does not
        depend on the others. `start`: the first block's modulation and modulated input, from
        `first_block_input` over the whole batch (blocks must then start at block 0)."""
        B = img.shape[0]
        padding = inputs.padding
        subset = rows if rows is not None and len(rows) < B else None
        if subset is not None:
            img, txt = take_rows(img, subset), take_rows(txt, subset)
            mask = None if inputs.text_mask is None else take_rows(inputs.text_mask, subset)
            padding = TextPadding.build(mask, len(subset), txt.shape[1], img.shape[1], self.padded_attention)
        # ModuleList items read as Module; __init__ fills this one with TransformerBlocks only.
        for block in cast("Iterable[TransformerBlock]", self.transformer_blocks[blocks]):
            img_in = None
            if start is not None:
                img_mod, txt_mod, img_in = start.img_mod, start.txt_mod, start.img_in
                img_in = img_in if subset is None else take_rows(img_in, subset)
                start = None
            else:
                img_mod, txt_mod = block.modulation(inputs.temb, inputs.mod_key, self.modulation_cache)
                img_mod = inputs.image_modulation(block, img_mod)
            if subset is not None and B > 1:  # one modulation row per image: this subset's
                img_mod = _take_modulation_rows(img_mod, subset, B)
                txt_mod = take_rows(txt_mod, subset) if txt_mod.shape[0] == B else txt_mod
            img, txt = block.body(
                img, txt, img_mod, txt_mod, padding, inputs.rope, self.attention_stats, img_in
            )
        return img, txt


@dataclass(frozen=True)
class BlockInputs:
    """What every block of one forward takes besides the two streams."""

    temb: torch.Tensor  # (B or 1, D)
    padding: TextPadding
    rope: tuple[Rotation, Rotation]
    mod_key: ModulationKey | None
    text_mask: torch.Tensor | None  # (B, L) or None: what `padding` was built from
    # zero_cond_t (2511) with sources: the timestep embedding at t = 0 that modulates the image
    # tokens from `target` on (the sources'); None: one modulation for every image token.
    cond_temb: torch.Tensor | None = None
    target: int = 0

    def image_modulation(self, block: TransformerBlock, img_mod: torch.Tensor) -> ImageModulation:
        """`block`'s image modulation for this forward: its own, or split at the sources."""
        if self.cond_temb is None:
            return img_mod
        return SplitModulation(img_mod, block.img_mod(self.cond_temb), self.target)


@dataclass(frozen=True)
class BlockStart:
    """Block 0's (img_mod, txt_mod) and modulated image input, each over the whole batch."""

    img_mod: ImageModulation
    txt_mod: torch.Tensor
    img_in: torch.Tensor


def _take_modulation_rows(mod: ImageModulation, rows: list[int], batch: int) -> ImageModulation:
    """The image modulation of batch rows `rows` (a modulation of one row, for all, is kept)."""
    if isinstance(mod, SplitModulation):
        target, cond = (_take_modulation_rows(m, rows, batch) for m in (mod.target, mod.cond))
        return SplitModulation(cast(torch.Tensor, target), cast(torch.Tensor, cond), mod.split)
    return take_rows(mod, rows) if mod.shape[0] == batch else mod


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along dim 0 (x itself when the rows are the whole batch)."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(rows, device=x.device))


def prepare_inputs(
    latents: torch.Tensor,
    embeds: torch.Tensor,
    mask: torch.Tensor | None,
    timestep: torch.Tensor,
    grid: tuple[int, int],
    *,
    source_latents: torch.Tensor | None = None,
    source_grids: tuple[tuple[int, int], ...] = (),
) -> dict[str, Any]:
    """The Qwen-Image DiT's inputs for one call of the shared denoise loop
    (model.generation.sampling.PrepareInputs): `forward`'s keyword arguments.

    An edit model's (the pipeline binds them): the sources' packed latents (B, S, C), the same
    every step, after the target's noisy latents, and their grids ((h, w) in packed tokens each,
    in the row's order) after the target's in img_shapes. A batch of both CFG branches (2B rows)
    takes the sources twice."""
    h, w = grid
    hidden = latents
    if source_latents is not None:
        repeat = latents.shape[0] // source_latents.shape[0]
        hidden = torch.cat([latents, source_latents.to(latents.dtype).repeat(repeat, 1, 1)], dim=1)
    return {
        "hidden_states": hidden,
        "encoder_hidden_states": embeds,
        "encoder_hidden_states_mask": mask,
        "timestep": timestep,
        "img_shapes": [[(1, h, w), *((1, sh, sw) for sh, sw in source_grids)]] * latents.shape[0],
    }


@dataclass(frozen=True)
class EditInputs:
    """`prepare_inputs` with an edit model's sources bound: the PrepareInputs of one batch's
    denoise loop (model.generation.pipeline)."""

    source_latents: torch.Tensor  # (B, S, C) packed, every source of a row in its order
    source_grids: tuple[tuple[int, int], ...]  # each source's (h, w) in packed tokens

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return prepare_inputs(
            *args, source_latents=self.source_latents, source_grids=self.source_grids, **kwargs
        )


def batch_grids(img_shapes: list) -> tuple[tuple[int, int, int], ...]:
    """The batch's (frames, h, w) grids, target first: all samples share them (one resolution
    bucket and one set of source sizes per batch)."""
    per_sample = [image_shapes(s) for s in img_shapes]
    first = per_sample[0]
    if any(s != first for s in per_sample):
        raise ValueError(f"img_shapes: every sample of a batch must share its grids, got {img_shapes}")
    return first
