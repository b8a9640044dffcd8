"""Rotary position embedding of the Qwen-Image MMDiT.

Three axes (frame, height, width) with (16, 56, 56) of the head dimension each; pairs are
interleaved ((x0, x1), (x2, x3), ...). Image positions are centred: a grid of h rows gets
positions -(h - h//2) .. h//2 - 1. Text token j gets the position max(h//2, w//2) + j on all
three axes, so text never collides with the image grid.

Computed as real cos/sin tables (no complex tensors) so the whole forward stays compile-friendly
and bf16-safe: the rotation itself runs in fp32.
"""

from __future__ import annotations

import torch


def _axis_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """positions (N,) -> angles (N, dim/2), fp32."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return torch.outer(positions.to(torch.float32), inv_freq)


def centred_positions(n: int) -> torch.Tensor:
    """-(n - n//2), ..., -1, 0, ..., n//2 - 1 (length n)."""
    return torch.arange(n, dtype=torch.float32) - (n - n // 2)


class RotaryTables:
    """cos/sin tables for one (grid, text length) shape, cached per shape and device.

    The cache key is static Python data, so a compiled forward sees constants, and a new
    shape costs one small CPU computation.
    """

    def __init__(self, axes_dims: tuple[int, int, int], theta: float = 10000.0) -> None:
        if any(d % 2 for d in axes_dims):
            raise ValueError(f"RoPE axes dims must be even, got {axes_dims}")
        self.axes_dims = tuple(axes_dims)
        self.theta = theta
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def angles(
        self, frames: int, height: int, width: int, text_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles (image tokens, head_dim/2) and (text tokens, head_dim/2) in fp32 on CPU."""
        d_f, d_h, d_w = self.axes_dims
        f_pos = torch.arange(frames, dtype=torch.float32)
        h_pos = centred_positions(height)
        w_pos = centred_positions(width)
        f_ang = _axis_angles(f_pos, d_f, self.theta)[:, None, None, :].expand(frames, height, width, -1)
        h_ang = _axis_angles(h_pos, d_h, self.theta)[None, :, None, :].expand(frames, height, width, -1)
        w_ang = _axis_angles(w_pos, d_w, self.theta)[None, None, :, :].expand(frames, height, width, -1)
        img = torch.cat([f_ang, h_ang, w_ang], dim=-1).reshape(frames * height * width, -1)
        start = max(height // 2, width // 2)
        t_pos = torch.arange(start, start + text_len, dtype=torch.float32)
        txt = torch.cat([_axis_angles(t_pos, d, self.theta) for d in self.axes_dims], dim=-1)
        return img, txt

    def tables(
        self, img_shape: tuple[int, int, int], text_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(img_cos, img_sin, txt_cos, txt_sin), each (tokens, head_dim/2) fp32 on `device`."""
        key = (tuple(img_shape), int(text_len), str(device))
        hit = self._cache.get(key)
        if hit is None:
            img, txt = self.angles(*img_shape, text_len)
            hit = tuple(t.to(device) for t in (img.cos(), img.sin(), txt.cos(), txt.sin()))  # type: ignore[assignment]
            if len(self._cache) > 64:  # bounded: buckets x prompt-length buckets is small
                self._cache.clear()
            self._cache[key] = hit  # type: ignore[assignment]
        return hit  # type: ignore[return-value]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs. x (B, S, H, D); cos/sin (S, D/2) -> (B, S, H, D) in x.dtype."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, S, H, D/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).to(x.dtype)
