"""Loading diffusers-layout components: `config.json` + safetensors (one file or sharded).

Modules are built on the meta device and then filled with `load_state_dict(assign=True)`, so a
20 GB transformer is never allocated twice. Every key must match: a missing or unexpected key is
an error that names the keys, never a silently half-random model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

# The torch-free readers of a component folder live in model.loading.folder; re-exported here.
from ditfleet.model.loading.folder import (  # noqa: F401
    PICKLE_SUFFIXES,
    WeightsError,
    drop_ignored_keys,
    read_config,
    safetensors_files,
)


class _SkipInit(TorchFunctionMode):
    """`torch.nn.init.*` leaves its tensor as it is; every other call runs unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # every torch.nn.init function names it so
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device and skip their random init.

    The init of a meta tensor computes nothing, but `normal_` on meta runs torch's Python reference
    kernels, whose first call imports torch._dynamo: about 1.7 s of every process start that loads
    a model and never compiles (CPU actors, the CLI's checks).
    """
    with torch.device("meta"), _SkipInit():
        yield


def read_state_dict(component_dir: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(component_dir):
        state.update(load_file(str(f), device=str(device)))
    return state


def check_state_matches(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Every key the model expects is in the checkpoint with its shape, and nothing else.

    Both sides are {key: shape}: the model's from its state dict, the checkpoint's from tensors or
    from safetensors headers (so a mismatch is found before any weight is read).
    """
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {missing[:20]}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {unexpected[:20]}")
        raise WeightsError(
            f"{where}: the checkpoint does not match the model built from its config.json: "
            + "; ".join(parts)
            + ". Check that the config.json belongs to these weights."
        )
    bad = [f"{k}: checkpoint {got[k]} vs model {expected[k]}" for k in expected if got[k] != expected[k]]
    if bad:
        raise WeightsError(
            f"{where}: shape mismatch for {len(bad)} keys, e.g. {bad[:5]}. "
            "Check that the config.json belongs to these weights."
        )


def assign_state_dict(
    module: torch.nn.Module,
    state: dict[str, torch.Tensor],
    where: str,
    dtype: torch.dtype,
    device: str | torch.device,
    ignore_prefixes: Iterable[str] = (),
) -> torch.nn.Module:
    """Fill a meta-device `module` from `state`, strictly, floating tensors cast to `dtype`.

    `ignore_prefixes` names checkpoint keys this module deliberately does not hold (e.g. the VAE
    encoder when only decoding).
    """
    ignore = tuple(ignore_prefixes)
    state = {k: v for k, v in state.items() if not k.startswith(ignore)} if ignore else state
    check_state_matches(
        {k: tuple(v.shape) for k, v in module.state_dict().items()},
        {k: tuple(v.shape) for k, v in state.items()},
        where,
    )
    cast = {
        k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device=device)
        for k, v in state.items()
    }
    module.load_state_dict(cast, strict=True, assign=True)
    return module
