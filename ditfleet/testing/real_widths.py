"""Checkpoints at Qwen-Image's published widths with random weights, stored the way the hub does.

The published configs (ditfleet/testing/published) with `num_layers` cut down: hidden 3072 (24 heads of
128), text dim 3584, the full VAE. Weights are random, in bf16, the transformer in several
`diffusion_pytorch_model-0000i-of-0000n.safetensors` shards plus the `.index.json` that maps every
tensor to its shard, like the hub's 9 x 5 GB. Weights are drawn tensor by tensor (PyTorch's
default Linear scale) and written shard by shard, so even a full-depth layout never needs the
whole model in memory at once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from ditfleet.testing import PUBLISHED

SHARD_STEM = "diffusion_pytorch_model"


def published_config(model: str, rel: str) -> dict:
    return json.loads((PUBLISHED / model / rel).read_text())


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic per (seed, name): the same checkpoint whatever the shard size or order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    if name.endswith(".weight") and len(shape) == 1:  # norm scales: around 1
        return 1 + 0.1 * torch.randn(shape, generator=g)
    fan_in = shape[1] if len(shape) > 1 else shape[0]
    bound = fan_in**-0.5  # nn.Linear's default init range
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def write_sharded(
    tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, shard_bytes: int, stem: str = SHARD_STEM
) -> list[Path]:
    """Write (name, tensor) pairs as hub-style shards + `<stem>.safetensors.index.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    tmp_files: list[Path] = []
    weight_map: dict[str, int] = {}
    total = 0

    def flush() -> None:
        path = out_dir / f".part-{len(tmp_files):05d}.safetensors"
        save_file(parts[-1], str(path), metadata={"format": "pt"})
        tmp_files.append(path)
        parts[-1] = {}
        sizes[-1] = 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if parts[-1] and sizes[-1] + nbytes > shard_bytes:
            flush()
        parts[-1][name] = t.contiguous()
        sizes[-1] += nbytes
        weight_map[name] = len(tmp_files)
        total += nbytes
    if parts[-1]:
        flush()
    n = len(tmp_files)
    names = [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_files, names):
        tmp.rename(out_dir / name)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
    }
    (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out_dir / name for name in names]


def transformer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the transformer a config describes (built on meta)."""
    from ditfleet.model.transformer import QwenImageTransformer, TransformerConfig

    with torch.device("meta"):
        model = QwenImageTransformer(TransformerConfig.from_dict(config))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_random_transformer(
    out_dir: Path, config: dict, shard_bytes: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> list[Path]:
    shapes = transformer_shapes(config)
    files = write_sharded(
        ((k, _random_tensor(k, s, seed).to(dtype)) for k, s in shapes.items()), out_dir, shard_bytes
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return files


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
    model: str = "qwen-image",
    seed: int = 0,
) -> Path:
    """A Qwen-Image checkpoint folder (no text encoder) at the published widths, `num_layers` deep."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PUBLISHED / model / "model_index.json", root / "model_index.json")
    (root / "scheduler").mkdir(exist_ok=True)
    shutil.copy(PUBLISHED / model / "scheduler" / "scheduler_config.json", root / "scheduler")
    config = {**published_config(model, "transformer/config.json"), "num_layers": num_layers}
    write_random_transformer(root / "transformer", config, shard_bytes, seed)
    write_random_vae(root / "vae", published_config(model, "vae/config.json"), seed)
    return root
