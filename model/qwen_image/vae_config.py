"""The VAE's config.json as a frozen dataclass, without torch (`model.memory` reads it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DIFFUSERS_CLASS = "AutoencoderKLQwenImage"

# diffusers' defaults for AutoencoderKLQwenImage (the released Qwen-Image VAE).
# fmt: off
_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
         0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# fmt: on


@dataclass(frozen=True)
class VAEConfig:
    """The keys of diffusers' `vae/config.json` (their spelling, `temperal_downsample` included)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = field(default=_MEAN)
    latents_std: tuple[float, ...] = field(default=_STD)

    def __post_init__(self) -> None:
        problems = []
        if self.base_dim <= 0 or self.z_dim <= 0 or self.num_res_blocks < 0 or self.input_channels <= 0:
            problems.append("base_dim, z_dim, input_channels must be > 0 and num_res_blocks >= 0")
        if len(self.dim_mult) < 2:
            problems.append(f"dim_mult {list(self.dim_mult)} needs at least 2 entries")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            problems.append(
                f"temperal_downsample has {len(self.temperal_downsample)} entries, needs len(dim_mult) - 1 = "
                f"{len(self.dim_mult) - 1}"
            )
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                problems.append(f"{name} has {len(getattr(self, name))} entries, needs z_dim = {self.z_dim}")
        if any(s <= 0 for s in self.latents_std):
            problems.append("latents_std entries must be > 0")
        if problems:
            raise ValueError("Invalid VAE config: " + "; ".join(problems) + ".")

    @property
    def spatial_compression(self) -> int:
        return 2 ** len(self.temperal_downsample)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "VAE config") -> VAEConfig:
        """Build from a diffusers config dict; keys starting with '_' (`_class_name`, ...) are metadata."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(
                f"{source}: unknown key(s) {unknown} for a Qwen-Image VAE (known: {sorted(known)}). "
                "Check that this is an AutoencoderKLQwenImage config."
            )
        kwargs: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known
        }
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    def to_dict(self) -> dict:
        """The diffusers `config.json` content for this config."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"_class_name": DIFFUSERS_CLASS, **d}
