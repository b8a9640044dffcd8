"""Checkpoints at Qwen-Image's published widths with random weights, stored the way the hub does.

The family's published configs (`ModelFamily.published_config`) with `num_layers` cut down: hidden 3072 (24 heads of
128), text dim 3584, the full VAE. Weights are random, in bf16, the transformer in several
`diffusion_pytorch_model-0000i-of-0000n.safetensors` shards plus the `.index.json` that maps every
tensor to its shard, like the hub's 9 x 5 GB, written by the node self-test's own writer
(workers/selftest/parts.py); the VAE is diffusers' own, saved as the hub's one file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ditfleet.model.family import DEFAULT_FAMILY, ModelFamily
from ditfleet.workers.selftest.parts import SHARD_STEM, write_random_transformer


def write_random_vae(out_dir: Path, config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
    """The published VAE with diffusers' own random init, saved as one file like the hub's."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage.from_config(config).to(dtype)
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / f"{SHARD_STEM}.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))  # the published file itself


def write_real_widths_checkpoint(
    root: Path,
    num_layers: int = 1,
    shard_bytes: int = 256 * 2**20,
    seed: int = 0,
    family: ModelFamily = DEFAULT_FAMILY,
) -> Path:
    """A checkpoint folder of `family` (no text encoder) at its published widths, `num_layers` deep."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(family.published_dir / "model_index.json", root / "model_index.json")
    (root / "scheduler").mkdir(exist_ok=True)
    shutil.copy(family.published_dir / "scheduler" / "scheduler_config.json", root / "scheduler")
    config = family.published_config("transformer/config.json", num_layers)
    write_random_transformer(root / "transformer", config, shard_bytes, seed)
    write_random_vae(root / "vae", family.published_config("vae/config.json"), seed)
    return root
