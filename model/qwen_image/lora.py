"""LoRA adapters in the diffusers/PEFT safetensors layout, merged into the transformer at load.

A LoRA file holds, per adapted `nn.Linear`, two factors: A (rank, in) and B (out, rank); the
layer becomes W + scaling * B @ A. The key layouts read are the ones diffusers' Qwen-Image LoRA
loader accepts:

- diffusers/PEFT: `transformer.<module>.lora_A.weight` / `.lora_B.weight` (+ `.lora_B.bias`),
  PEFT's adapter-named `.lora_A.default.weight`, PEFT's own `base_model.model.` prefix;
- kohya / ComfyUI / musubi: `.lora_down.weight` / `.lora_up.weight`, prefixes `diffusion_model.`
  or `lora_unet_` (module dots flattened to underscores), or bare module names;
- an optional `<module>.alpha` per layer: alpha / rank is folded into the two factors before
  the merge, exactly as diffusers folds it;
- the `lora_adapter_metadata` that diffusers' `save_lora_weights` writes into the safetensors
  header (PEFT's `r`, `lora_alpha`, `rank_pattern`, `alpha_pattern`, `use_rslora`): scaling
  lora_alpha / r per layer, as PEFT sets it.

The job's `scale` multiplies the scaling (PEFT's `set_adapters(..., weights)`).

Merging follows PEFT's `merge` (what `fuse_lora` calls) step for step, so that a merged model
holds bit-for-bit the weights diffusers' `load_lora_weights` + `fuse_lora` produce: the factors
are cast to the model's dtype, delta = (B @ A) * scaling is computed in that dtype (in fp32 and
rounded back for bf16/fp16 on the CPU, as PEFT does), and added to W in place, in the model's
dtype, one adapter after another. Merging in fp32 and rounding W once would be slightly more
accurate, but would not be the model users validated with diffusers.

Every problem is found before any weight moves to the device: a missing or unreadable file, a
key that names no layer of this transformer (listed), factors whose shapes do not fit the layer.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ditfleet.model.loading.lora_spec import LoraSpec  # noqa: F401 - re-exported: the spec is torch-free
from ditfleet.model.loading.weights import PICKLE_SUFFIXES, WeightsError

# diffusers' key for the PEFT LoraConfig it writes into the safetensors header.
METADATA_KEY = "lora_adapter_metadata"
_PREFIXES = ("transformer.", "diffusion_model.", "base_model.model.")
_FLAT_PREFIX = "lora_unet_"
_FACTOR = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.default)?\.(?P<param>weight|bias)$"
)
_ALPHA = re.compile(r"^(?P<module>.+)\.alpha$")
# Adapter kinds that are not a plain low-rank update: merging them as one would be wrong.
_OTHER_ADAPTERS = {
    "dora_scale": "DoRA",
    "lora_magnitude_vector": "DoRA",
    "lokr_": "LoKr",
    "hada_": "LoHa",
    "lora_mid": "LoCon (conv LoRA)",
}
_SHOW = 20  # keys listed in an error message


class LoraError(WeightsError):
    """A LoRA file that cannot be merged into this model; the message names the file and keys."""


@dataclass
class _Factors:
    """The tensors of one adapted layer, as the file names it."""

    down: torch.Tensor | None = None  # A: (rank, in)
    up: torch.Tensor | None = None  # B: (out, rank)
    bias: torch.Tensor | None = None  # B's bias: (out,)
    alpha: float | None = None
    keys: list[str] = field(default_factory=list)


@dataclass
class LoraFile:
    """A LoRA file read and checked on its own, not yet matched to a model."""

    path: Path
    scale: float
    sha256: str  # of the file's bytes: two adapters with the same shapes differ here
    layers: dict[tuple[str, bool], _Factors]  # (module name, flattened with '_') -> factors
    config: dict  # PEFT LoraConfig fields from the header metadata ({} when none)


@dataclass(frozen=True)
class LayerUpdate:
    """W += scaling * up @ down for the nn.Linear called `module`."""

    module: str
    down: torch.Tensor  # (rank, in), alpha folded in, in the file's dtype
    up: torch.Tensor  # (out, rank)
    bias: torch.Tensor | None  # (out,)
    scaling: float
    source: str  # the file, for messages


def read_lora(spec: LoraSpec) -> LoraFile:
    """Read and check one adapter file (CPU only); LoraError names the file and the keys."""
    path = Path(spec.path)
    if not path.is_file():
        raise LoraError(
            f"LoRA {path}: no such file. Give the path of a .safetensors LoRA file on every node."
        )
    if path.suffix in PICKLE_SUFFIXES:
        raise LoraError(
            f"LoRA {path}: pickle files can run code when loaded and are refused; use the .safetensors "
            "version of the adapter."
        )
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds for a bad file
        raise LoraError(f"LoRA {path}: not a readable safetensors file ({e}).") from None
    if not tensors:
        raise LoraError(f"LoRA {path}: the file holds no tensors.")
    layers, unknown = _group_keys(path, tensors)
    if unknown:
        raise LoraError(
            f"LoRA {path}: {len(unknown)} keys are not LoRA factors (lora_A/lora_B, lora_down/lora_up, "
            f"alpha): {unknown[:_SHOW]}. Is this a LoRA file?"
        )
    _fold_alpha(path, layers)
    return LoraFile(path, float(spec.scale), digest.hexdigest(), layers, _peft_config(path, header))


def _group_keys(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    layers: dict[tuple[str, bool], _Factors] = {}
    unknown: list[str] = []
    for key in sorted(tensors):
        for marker, kind in _OTHER_ADAPTERS.items():
            if marker in key:
                raise LoraError(
                    f"LoRA {path}: key {key} belongs to a {kind} adapter; only plain LoRA "
                    "(lora_A/lora_B or lora_down/lora_up) can be merged."
                )
        name, flat = key, False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        else:
            if name.startswith(_FLAT_PREFIX):
                name, flat = name[len(_FLAT_PREFIX) :], True
        factor, alpha = _FACTOR.match(name), _ALPHA.match(name)
        if factor is None and alpha is None:
            unknown.append(key)
            continue
        module = (factor or alpha).group("module")  # type: ignore[union-attr]
        entry = layers.setdefault((module, flat), _Factors())
        entry.keys.append(key)
        t = tensors[key]
        if alpha is not None:
            if t.numel() != 1:
                raise LoraError(
                    f"LoRA {path}: {key} must hold one number (alpha), has shape {tuple(t.shape)}"
                )
            entry.alpha = float(t.item())
            continue
        kind, param = factor.group("kind"), factor.group("param")  # type: ignore[union-attr]
        if kind in ("lora_A", "lora_down"):
            if param != "weight":
                unknown.append(key)  # PEFT has no bias on A
                continue
            entry.down = t
        elif param == "bias":
            entry.bias = t
        else:
            entry.up = t
    for (module, _), entry in layers.items():
        if entry.down is None or entry.up is None:
            missing = "lora_A (lora_down)" if entry.down is None else "lora_B (lora_up)"
            raise LoraError(f"LoRA {path}: layer {module} has {entry.keys} but no {missing} weight.")
        if entry.down.ndim != 2 or entry.up.ndim != 2 or entry.up.shape[1] != entry.down.shape[0]:
            raise LoraError(
                f"LoRA {path}: layer {module}: factors of shapes {tuple(entry.down.shape)} (A) and "
                f"{tuple(entry.up.shape)} (B) do not form a rank-r update B @ A."
            )
    return layers, unknown


def _fold_alpha(path: Path, layers: dict[tuple[str, bool], _Factors]) -> None:
    """alpha / rank into the factors, split between them and in the file's dtype, as diffusers does."""
    for entry in layers.values():
        if entry.alpha is None:
            continue
        assert entry.down is not None and entry.up is not None
        scale_down, scale_up = entry.alpha / entry.down.shape[0], 1.0
        while scale_down * 2 < scale_up:  # keep both factors' magnitudes alike for low-precision files
            scale_down *= 2
            scale_up /= 2
        entry.down = entry.down * scale_down
        entry.up = entry.up * scale_up


def _peft_config(path: Path, header: dict[str, str]) -> dict:
    raw = header.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"LoRA {path}: header metadata {METADATA_KEY} is not valid JSON ({e}).") from None
    # diffusers prefixes each field with the component it belongs to.
    config = {k.removeprefix("transformer."): v for k, v in meta.items() if not k.startswith("text_encoder")}
    if config.get("use_dora"):
        raise LoraError(
            f"LoRA {path}: a DoRA adapter (use_dora in its metadata); only plain LoRA can be merged."
        )
    return config


# -- matching a file to the model ----------------------------------------------------------------


def plan_updates(files: Sequence[LoraFile], model: torch.nn.Module) -> list[LayerUpdate]:
    """Match every layer of every file to an nn.Linear of `model` (which may live on the meta
    device) and check the shapes; LoraError lists every key that names no layer."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    flat = {name.replace(".", "_"): name for name in linears}
    updates: list[LayerUpdate] = []
    for lora in files:
        unmatched: list[str] = []
        for (raw, is_flat), entry in lora.layers.items():
            module = flat.get(raw) if is_flat else (raw if raw in linears else None)
            if module is None:
                unmatched += entry.keys
                continue
            assert entry.down is not None and entry.up is not None
            layer = linears[module]
            rank = entry.down.shape[0]
            if entry.down.shape[1] != layer.in_features or entry.up.shape[0] != layer.out_features:
                raise LoraError(
                    f"LoRA {lora.path}: {entry.keys[0]}: factors {tuple(entry.up.shape)} @ "
                    f"{tuple(entry.down.shape)} give a {entry.up.shape[0]}x{entry.down.shape[1]} update, but "
                    f"{module} is {layer.out_features}x{layer.in_features}. Is this LoRA for another model?"
                )
            if entry.bias is not None:
                if layer.bias is None or tuple(entry.bias.shape) != (layer.out_features,):
                    raise LoraError(
                        f"LoRA {lora.path}: {module}: a lora_B bias of shape {tuple(entry.bias.shape)} "
                        f"does not fit the layer (bias {'absent' if layer.bias is None else tuple(layer.bias.shape)})."
                    )
            scaling = lora.scale * _peft_scaling(lora, module, rank)
            updates.append(LayerUpdate(module, entry.down, entry.up, entry.bias, scaling, str(lora.path)))
        if unmatched:
            n_keys = sum(len(e.keys) for e in lora.layers.values())
            what = "none of its" if len(unmatched) == n_keys else f"{len(unmatched)} of its"
            raise LoraError(
                f"LoRA {lora.path}: {what} {n_keys} keys name a linear layer of this transformer: "
                f"{sorted(unmatched)[:_SHOW]}. Qwen-Image LoRA keys look like "
                "transformer.transformer_blocks.0.attn.to_q.lora_A.weight; is this LoRA for another model "
                "(or for the text encoder, which is not supported)?"
            )
    return updates


def _peft_scaling(lora: LoraFile, module: str, rank: int) -> float:
    """lora_alpha / r for this layer from the header's LoraConfig; 1 without one (alpha = rank)."""
    c = lora.config
    if not c:
        return 1.0
    # PEFT's LoraConfig defaults (r = lora_alpha = 8) where the metadata leaves a field out.
    r = _pattern_value(c.get("rank_pattern") or {}, module, c.get("r", 8))
    alpha = _pattern_value(c.get("alpha_pattern") or {}, module, c.get("lora_alpha", 8))
    if int(r) != rank:
        raise LoraError(
            f"LoRA {lora.path}: {module}: its metadata says rank {r} but the factors have rank {rank}."
        )
    return alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first pattern matching the module name's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


# -- merging --------------------------------------------------------------------------------------


@torch.no_grad()
def merge_updates(model: torch.nn.Module, updates: Sequence[LayerUpdate]) -> None:
    """Add each update into its layer's weight (and bias), in place, in the weight's dtype."""
    for u in updates:
        layer = model.get_submodule(u.module)
        if not isinstance(layer, torch.nn.Linear):  # e.g. an FP8 layer: merge before quantizing
            raise LoraError(
                f"{u.module} is a {type(layer).__name__}, not a Linear: cannot merge a LoRA into it"
            )
        merge_into(layer.weight, layer.bias, u)


@torch.no_grad()
def merge_into(weight: torch.Tensor | None, bias: torch.Tensor | None, u: LayerUpdate) -> None:
    """Add one update into a layer's weight and/or bias tensors (either may be None), in place.

    The FP8 loader (model.qwen_image.fp8) calls this on each weight as it streams in, before quantizing."""
    if weight is not None:
        w = weight
        down = u.down.to(device=w.device, dtype=w.dtype)
        up = u.up.to(device=w.device, dtype=w.dtype)
        if w.device.type == "cpu" and w.dtype in (torch.float16, torch.bfloat16):
            # Half-precision matmuls are slow (and rounded differently) on CPUs: PEFT computes
            # the delta in fp32 there and rounds it once.
            delta = (up.float() @ down.float()).mul_(u.scaling).to(w.dtype)
        else:
            delta = (up @ down).mul_(u.scaling)  # in place: one (out, in) temporary, not two
        w += delta
    if bias is not None and u.bias is not None:
        bias += u.bias.to(device=bias.device, dtype=bias.dtype) * u.scaling


def adapters_revision(base_revision: str, files: Sequence[LoraFile]) -> str:
    """The model revision with the adapters merged into it: another adapter, or another scale,
    makes other images, so it is another model."""
    if not files:
        return base_revision
    h = hashlib.sha256(base_revision.encode())
    for f in files:
        h.update(f"lora:{f.sha256}:{f.scale!r};".encode())
    return h.hexdigest()[:16]
