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

    def qkv(
        self,
        img: torch.Tensor,  # (B, N, D), normed and modulated
        txt: torch.Tensor,  # (B, L, D)
        rope: tuple[Rotation, Rotation],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, N + L, hd): image tokens first, then text."""
        img_rot, txt_rot = rope
        split = (-1, self.head_dim)
        q = torch.cat(
            [
                _rms_rotary(self.to_q(img).unflatten(-1, split), self.norm_q, img_rot),
                _rms_rotary(self.add_q_proj(txt).unflatten(-1, split), self.norm_added_q, txt_rot),
            ],
            dim=1,
        )  # (B, N + L, H, hd)
        k = torch.cat(
            [
                _rms_rotary(self.to_k(img).unflatten(-1, split), self.norm_k, img_rot),
                _rms_rotary(self.add_k_proj(txt).unflatten(-1, split), self.norm_added_k, txt_rot),
            ],
            dim=1,
        )
        v = torch.cat([self.to_v(img).unflatten(-1, split), self.add_v_proj(txt).unflatten(-1, split)], dim=1)
        return q.transpose(1, 2), k.transpose(1, 2), v.to(q.dtype).transpose(1, 2)

    def project_out(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-stream attention outputs (B, N, D), (B, L, D) -> their output projections."""
        return self.to_out[0](img), self.to_add_out(txt)


def split_streams(out: torch.Tensor, image_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, H, N + L, hd) -> contiguous image (B, N, D) and text (B, L, D)."""
    B, H, S, hd = out.shape
    out = out.transpose(1, 2).reshape(B, S, H * hd)  # a view when SDPA returned (B, S, H, hd) memory
    # Two fresh dense tensors, always copied: a compiled consumer then sees the same strides and
    # offset whatever the batch size, text length or the attention kernel's output layout.
    contiguous = torch.contiguous_format
    return out[:, :image_len].clone(memory_format=contiguous), out[:, image_len:].clone(
        memory_format=contiguous
    )


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
        img_mod: torch.Tensor,  # (B or 1, 6D)
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
        img_attn, txt_attn = split_streams(attn, img.shape[1])
        return self.attention_outputs(img, txt, img_attn, txt_attn, img_mod, txt_mod)

    def modulated_input(self, img: torch.Tensor, img_mod: torch.Tensor) -> torch.Tensor:
        """The image stream as the attention sees it, LayerNorm then the first shift and scale,
        (B, N, D): block 0's is TeaCache's signal of how much a step changes (model.generation.step_cache)."""
        i_sh1, i_sc1 = img_mod.chunk(6, dim=-1)[:2]
        return _norm_modulate(img, i_sh1, i_sc1, self.eps)

    def attention_inputs(
        self,
        img: torch.Tensor,  # (B, N, D)
        txt: torch.Tensor,  # (B, L, D)
        img_mod: torch.Tensor,  # (B or 1, 6D)
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
        img_attn: torch.Tensor,  # (B, N, D) attention output, before its projection
        txt_attn: torch.Tensor,  # (B, L, D)
        img_mod: torch.Tensor,  # (B or 1, 6D)
        txt_mod: torch.Tensor,  # (B or 1, 6D)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projections, gated residuals, LayerNorm + modulate, MLPs: new (img, txt)."""
        _, _, i_g1, i_sh2, i_sc2, i_g2 = img_mod.chunk(6, dim=-1)
        _, _, t_g1, t_sh2, t_sc2, t_g2 = txt_mod.chunk(6, dim=-1)
        img_attn, txt_attn = self.attn.project_out(img_attn, txt_attn)
        img = _gated_residual(img, i_g1, img_attn)
        txt = _gated_residual(txt, t_g1, txt_attn)
        img = _gated_residual(img, i_g2, self.img_mlp(_norm_modulate(img, i_sh2, i_sc2, self.eps)))
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
        (B, N + S, C), and img_shapes each sample's grids in that order (the target's first); the
        sources are attended to and never predicted (model.qwen_image.edit).

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
        inputs = BlockInputs(temb, padding, rope, mod_key, encoder_hidden_states_mask)
        if step_cache is not None:
            img = step_cache.run(self, img, txt, inputs)
        else:
            img, _ = self.run_blocks(img, txt, inputs)
        if target != N:  # an edit model's source tokens: only the target's are predicted
            img = img[:, :target]
        return self.proj_out(self.norm_out(img, temb))

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
        img_mod, txt_mod = block.modulation(inputs.temb, inputs.mod_key, self.modulation_cache)
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
            if subset is not None and img_mod.shape[0] == B and B > 1:  # one modulation row per image
                img_mod, txt_mod = take_rows(img_mod, subset), take_rows(txt_mod, subset)
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


@dataclass(frozen=True)
class BlockStart:
    """Block 0's (img_mod, txt_mod) and modulated image input, each over the whole batch."""

    img_mod: torch.Tensor
    txt_mod: torch.Tensor
    img_in: torch.Tensor


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
) -> dict[str, Any]:
    """The Qwen-Image DiT's inputs for one call of the shared denoise loop
    (model.generation.sampling.PrepareInputs): `forward`'s keyword arguments."""
    h, w = grid
    return {
        "hidden_states": latents,
        "encoder_hidden_states": embeds,
        "encoder_hidden_states_mask": mask,
        "timestep": timestep,
        "img_shapes": [[(1, h, w)]] * latents.shape[0],
    }


@dataclass(frozen=True)
class EditInputs:
    """`prepare_inputs` for an edit model: the sources' packed latents (B, S, C), the same every
    step, after the target's noisy latents, and their grids ((h, w) in packed tokens each, in the
    row's order) after the target's in img_shapes. A batch of both CFG branches (2B rows) takes
    the sources twice."""

    source_latents: torch.Tensor
    source_grids: tuple[tuple[int, int], ...]

    def __call__(
        self,
        latents: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        timestep: torch.Tensor,
        grid: tuple[int, int],
    ) -> dict[str, Any]:
        inputs = prepare_inputs(latents, embeds, mask, timestep, grid)
        sources = self.source_latents
        if latents.shape[0] != sources.shape[0]:
            sources = sources.repeat(latents.shape[0] // sources.shape[0], 1, 1)
        inputs["hidden_states"] = torch.cat([latents, sources.to(latents.dtype)], dim=1)
        shapes = [(1, *grid), *((1, h, w) for h, w in self.source_grids)]
        inputs["img_shapes"] = [shapes] * latents.shape[0]
        return inputs


def batch_grids(img_shapes: list) -> tuple[tuple[int, int, int], ...]:
    """The batch's (frames, h, w) grids, target first: all samples share them (one resolution
    bucket and one set of source sizes per batch)."""
    per_sample = [image_shapes(s) for s in img_shapes]
    first = per_sample[0]
    if any(s != first for s in per_sample):
        raise ValueError(f"img_shapes: every sample of a batch must share its grids, got {img_shapes}")
    return first
