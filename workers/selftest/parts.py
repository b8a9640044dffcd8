"""What the self-test's stages share: the model's configs at the run's widths (the family's published
ones, or its toy ones with --tiny), weights made on the device or written as the hub's shards, timing and FLOP
counts."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from ditfleet.model.family import DEFAULT_FAMILY
from ditfleet.model.family_types import DiTConfig
from ditfleet.model.generation.sampling import LATENT_CHANNELS, latent_grid
from ditfleet.model.loading.quantization import QuantizationError
from ditfleet.model.memory import ModelMemory
from ditfleet.model.settings import DEFAULT_PIPELINE, Fp8Layers, Quantization
from ditfleet.workers.selftest.runner import Context

log = logging.getLogger("ditfleet.selftest")

# The family whose published widths the self-test measures: its configs and costs are the family's.
FAMILY = DEFAULT_FAMILY


# -- configs, weights, timing ----------------------------------------------------------------------


def config_file(ctx: Context, rel: str, layers: int | None = None) -> dict:
    """The family's config file `rel` at the run's widths (toy with --tiny, else published)."""
    widths = FAMILY.toy_config if ctx.tiny else FAMILY.published_config
    return widths(rel, layers)


def transformer_config(ctx: Context, layers: int) -> DiTConfig:
    """The family's DiT config at the run's widths, cut to `layers` blocks."""
    return FAMILY.dit_config(config_file(ctx, "transformer/config.json", layers))


def plan_model(ctx: Context, cfg: DiTConfig) -> ModelMemory:
    """The self-test's DiT (and VAE) as the memory plan sees them: the family's formula, no text encoder."""
    return FAMILY.memory.from_configs(
        cfg.to_dict(), config_file(ctx, "vae/config.json"), None, name="selftest"
    )


def sizes(ctx: Context) -> list[int]:
    """Square image sides of the speed lines, the bucket the worker uses most first."""
    return [64, 96] if ctx.tiny else list(ctx.args.sizes)


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def init_on_device(module: ModuleT, seed: int) -> ModuleT:
    """Fill an allocated (uninitialised) module in place on its device: nn.Linear's default range
    for matrices and biases, norm scales around 1. Seeded, so every run draws the same model."""
    g = None
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point():
            continue
        if g is None or g.device != p.device:
            g = torch.Generator(device=p.device).manual_seed(seed)
        with torch.no_grad():
            if name.endswith("weight") and p.dim() == 1 or "gamma" in name:
                p.normal_(1.0, 0.1, generator=g)
            else:
                fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else p.shape[0]
                p.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=g)
    return module


def make_transformer(
    cfg: DiTConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """The family's DiT straight on the device in `dtype`: built on meta, allocated there, filled
    there, its projections fused as the loader leaves them."""
    model = FAMILY.empty_transformer(cfg.to_dict()).to(dtype).to_empty(device=device)
    model = init_on_device(model, seed).eval().requires_grad_(False)
    FAMILY.fuse_projections(model)
    return model


def make_vae(ctx: Context) -> Any:
    """The run's VAE without its encoder, made like `make_transformer`."""
    vae = (
        FAMILY.empty_vae(config_file(ctx, "vae/config.json"), with_encoder=False)
        .to(ctx.dtype)
        .to_empty(device=ctx.device)
    )
    return init_on_device(vae, 0).eval().requires_grad_(False)


SHARD_STEM = "diffusion_pytorch_model"


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


def write_random_transformer(
    out_dir: Path, config: dict, shard_bytes: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> list[Path]:
    """The DiT of `config` with random weights in the hub's shards + index, and its config.json.
    Tensors are drawn one by one (PyTorch's default Linear range) and written shard by shard, so
    even a full-depth layout never holds the whole model in memory."""
    shapes = FAMILY.empty_transformer(config).state_dict()
    files = write_sharded(
        ((k, _random_tensor(k, tuple(t.shape), seed).to(dtype)) for k, t in shapes.items()),
        out_dir,
        shard_bytes,
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return files


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(ctx: Context, fn: Callable[[], object], repeat: int, warm: int = 1) -> float:
    """Median wall ms of `repeat` calls after `warm` calls, the device synchronised."""
    for _ in range(warm):
        fn()
    sync(ctx.device)
    times = []
    for _ in range(max(1, repeat)):
        ctx.check("timing")
        t0 = time.perf_counter()
        fn()
        sync(ctx.device)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def forward_flops(cfg: DiTConfig, size: int, text_len: int) -> float:
    """FLOPs of one DiT forward of one size x size image, as the family states its cost."""
    return FAMILY.forward_flops(cfg.to_dict(), size, size, text_len)


def dit_inputs(cfg: DiTConfig, size: int, text_len: int, batch: int, device, dtype, seed: int = 0):
    h, w = latent_grid(size, size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, h * w, 4 * LATENT_CHANNELS, generator=g).to(device, dtype)
    txt = torch.randn(batch, text_len, FAMILY.text_width(cfg.to_dict()), generator=g).to(device, dtype)
    return x, txt, [[(1, h, w)]] * batch


def diffusers_version() -> str | None:
    try:
        import diffusers
    except Exception:  # noqa: BLE001 - absent or broken: the lines that need it say so
        return None
    return diffusers.__version__


def free(ctx: Context, *names: str) -> None:
    for name in names:
        ctx.state.pop(name, None)
    if ctx.cuda:
        torch.cuda.empty_cache()


@torch.no_grad()
def fp8_copy(
    transformer: torch.nn.Module, mode: Quantization, layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers
) -> torch.nn.Module | None:
    """The loaded `transformer` as an FP8 DiT of `mode` with the layer set `layers` on its own
    device, the original untouched, or None when that device cannot run `mode` (fp8 on a GPU
    without FP8 units).

    Every tensor that stays in the load dtype (kept layers, norms) is shared with the original, not
    copied, so the copy costs only the FP8 weights and scales (20.5 GB beside a 40.9 GB bf16 DiT at
    Qwen-Image size): enough to compare both on one GPU."""
    try:
        FAMILY.check_quantization_device(mode, next(transformer.parameters()).device)
    except QuantizationError:
        return None
    shared = {id(t): t for t in (*transformer.parameters(), *transformer.buffers())}
    twin = copy.deepcopy(transformer, memo=dict(shared))
    for m in twin.modules():
        # A method compiled from outside (an instance attribute over the class's own, as
        # compile/ installs it) would be copied still bound to the original bf16 module: the
        # copy runs its own class methods, eager.
        for name in [k for k in vars(m) if callable(getattr(type(m), k, None)) and k != "training"]:
            del m.__dict__[name]
    FAMILY.quantize(twin, mode, layers)  # in place
    return twin.eval().requires_grad_(False)
