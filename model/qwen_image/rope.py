"""Rotary position embedding of the Qwen-Image MMDiT.

Three axes (frame, height, width) with (16, 56, 56) of the head dimension each; pairs are
interleaved ((x0, x1), (x2, x3), ...). Image positions are centred: a grid of h rows gets
positions -(h - h//2) .. h//2 - 1. Text token j gets the position max(h//2, w//2) + j on all
three axes, so text never collides with the image grid.

An edit model's sources are more grids after the target's, in one sequence (model.qwen_image.edit):
grid i (the target is 0) starts at frame index i, each centred on its own height and width, and
the text starts after the largest of them, max over grids of max(h//2, w//2).

The rotation runs in fp32 (bf16-safe). In eager it is one complex multiply per tensor (one
kernel, no stack or slicing round trips); while torch.compile traces it is written on real cos/sin
tables instead, which Inductor fuses into the neighbouring norm (it does not generate code for
complex tensors), in a stack-free form (`rotate_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _axis_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """positions (N,) -> angles (N, dim/2), fp32."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return torch.outer(positions.to(torch.float32), inv_freq)


def centred_positions(n: int) -> torch.Tensor:
    """-(n - n//2), ..., -1, 0, ..., n//2 - 1 (length n)."""
    return torch.arange(n, dtype=torch.float32) - (n - n // 2)


ImageShapes = tuple[tuple[int, int, int], ...]  # (frames, height, width) grids, target first


def image_shapes(shape: tuple[int, int, int] | ImageShapes | list) -> ImageShapes:
    """One (frames, height, width) grid or a sequence of them as a tuple of int triples."""
    if len(shape) and isinstance(shape[0], int):
        shape = (shape,)  # type: ignore[assignment]
    return tuple((int(f), int(h), int(w)) for f, h, w in shape)  # type: ignore[misc]


@dataclass(frozen=True)
class Rotation:
    """The rotation of one token range: cos/sin (S, D/2) fp32 and the same as complex64."""

    cos: torch.Tensor
    sin: torch.Tensor
    polar: torch.Tensor

    @classmethod
    def from_angles(cls, angles: torch.Tensor) -> Rotation:
        return cls(angles.cos(), angles.sin(), torch.polar(torch.ones_like(angles), angles))

    def to(self, device: torch.device) -> Rotation:
        return Rotation(self.cos.to(device), self.sin.to(device), self.polar.to(device))


class RotaryTables:
    """Rotations for one (grid, text length) shape, cached per shape and device.

    The cache key is static Python data, and a new grid costs one small CPU computation.
    """

    def __init__(self, axes_dims: tuple[int, int, int], theta: float = 10000.0) -> None:
        if any(d % 2 for d in axes_dims):
            raise ValueError(f"RoPE axes dims must be even, got {axes_dims}")
        self.axes_dims = tuple(axes_dims)
        self.theta = theta
        self._cache: dict[tuple, tuple[Rotation, Rotation]] = {}

    def grid_angles(self, frames: int, height: int, width: int, first_frame: int = 0) -> torch.Tensor:
        """Angles (frames * height * width, head_dim/2) of one grid whose first frame has index
        `first_frame`, fp32 on CPU."""
        d_f, d_h, d_w = self.axes_dims
        f_pos = torch.arange(first_frame, first_frame + frames, dtype=torch.float32)
        h_pos = centred_positions(height)
        w_pos = centred_positions(width)
        f_ang = _axis_angles(f_pos, d_f, self.theta)[:, None, None, :].expand(frames, height, width, -1)
        h_ang = _axis_angles(h_pos, d_h, self.theta)[None, :, None, :].expand(frames, height, width, -1)
        w_ang = _axis_angles(w_pos, d_w, self.theta)[None, None, :, :].expand(frames, height, width, -1)
        return torch.cat([f_ang, h_ang, w_ang], dim=-1).reshape(frames * height * width, -1)

    def angles(
        self, frames: int, height: int, width: int, text_len: int, sources: ImageShapes = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles (image tokens, head_dim/2) and (text tokens, head_dim/2) in fp32 on CPU: the
        (frames, height, width) grid, then each of `sources`' grids at the next frame index."""
        grids = ((frames, height, width), *sources)
        img = torch.cat([self.grid_angles(*g, first_frame=i) for i, g in enumerate(grids)])
        start = max(max(h // 2, w // 2) for _, h, w in grids)
        t_pos = torch.arange(start, start + text_len, dtype=torch.float32)
        txt = torch.cat([_axis_angles(t_pos, d, self.theta) for d in self.axes_dims], dim=-1)
        return img, txt

    def tables(
        self, img_shape: tuple[int, int, int] | ImageShapes, text_len: int, device: torch.device
    ) -> tuple[Rotation, Rotation]:
        """(image, text) rotations, (tokens, head_dim/2) each, on `device`. `img_shape`: one
        (frames, height, width) grid, or the target's then its sources' (an edit model's).

        The text rotation of the longest text length seen for a grid is kept and sliced, so
        prompts of every length share one table per grid.
        """
        grids = image_shapes(img_shape)
        key = (grids, str(device))
        hit = self._cache.get(key)
        if hit is None or hit[1].cos.shape[0] < text_len:
            longest = max(int(text_len), 64 if hit is None else 2 * hit[1].cos.shape[0])
            img, txt = self.angles(*grids[0], longest, grids[1:])
            hit = (Rotation.from_angles(img).to(device), Rotation.from_angles(txt).to(device))
            if len(self._cache) > 64:  # bounded: a job has a few resolution buckets
                self._cache.clear()
            self._cache[key] = hit
        img_rot, txt_rot = hit
        if txt_rot.cos.shape[0] != text_len:
            txt_rot = Rotation(txt_rot.cos[:text_len], txt_rot.sin[:text_len], txt_rot.polar[:text_len])
        return img_rot, txt_rot


def apply_rotary(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Rotate interleaved pairs of x (B, S, H, D) by (S, D/2) angles; fp32 (B, S, H, D).

    The result stays fp32 so that a caller can fold its cast into the next op.
    """
    xf = x.float().unflatten(-1, (-1, 2))  # (B, S, H, D/2, 2)
    if torch.compiler.is_compiling():
        return rotate_pairs(xf, rotation.cos, rotation.sin).flatten(-2)
    rotated = torch.view_as_complex(xf) * rotation.polar[None, :, None, :]  # one kernel
    return torch.view_as_real(rotated).flatten(-2)


# (x0, x1) -> (-x1, x0) after the swap: the sign of each half of a pair. Multiplying by +-1 is
# exact, so the rotation below rounds exactly as x0*c - x1*s, x0*s + x1*c would.
_PAIR_SIGN = (-1.0, 1.0)


def rotate_pairs(xf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x0, x1) -> (x0*c - x1*s, x0*s + x1*c) on xf (B, S, H, D/2, 2) with cos/sin (S, D/2), fp32.

    Written without stacking the two halves back together: one elementwise expression on the
    pair dimension (a flip of its two entries and a sign). A 5-D `torch.stack` of the halves makes
    torch 2.11's cat lowering guard the text length against 1, a recompile for one-token prompts;
    this form has no such guard and gives the same bits in fp32.
    """
    c = cos[None, :, None, :, None]  # (1, S, 1, D/2, 1)
    s = sin[None, :, None, :, None]
    sign = xf.new_tensor(_PAIR_SIGN)  # (2,)
    return xf * c + xf.flip(-1) * s * sign
