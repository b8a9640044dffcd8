"""Which fused SDPA kernel the DiT and VAE prefer on CUDA: `auto | cudnn | flash | efficient | math`.

`auto` leaves SDPA's own order alone (its default, until a GPU measurement says another is
faster: the node self-test reports the backend of every call). Another value moves that backend
to the front; the others stay enabled behind it, so a shape the preferred kernel does not take
(the VAE's 384-wide head is beyond the flash kernel's) still gets a fused one. `math` is the
reference path, for debugging. On the CPU nothing changes: the preference is CUDA only.

The choice is made by `torch.nn.attention.sdpa_kernel` around the pipeline's denoise and decode,
outside any compiled region: a compiled VAE traces under the same preference at warm-up as its
requests run under.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")

# torch._fused_sdp_choice's int -> our name (torch.nn.attention.SDPBackend's values)
BACKEND_NAMES = {-1: "none", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def backend_order(preference: str) -> list[str]:
    """The backends enabled for a preference, first choice first."""
    if preference not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {preference!r}")
    rest = ["flash", "cudnn", "efficient", "math"]
    return [preference] + [b for b in rest if b != preference]


def attention_backend(preference: str, device_type: str):
    """A context that applies the preference on CUDA; a no-op for `auto` or off CUDA."""
    if preference not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {preference!r}")
    if preference == "auto" or device_type != "cuda":
        return nullcontext()
    return _preferred(preference)


@contextmanager
def _preferred(preference: str):
    from torch.nn.attention import sdpa_kernel

    order = [_backend(b) for b in backend_order(preference)]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:  # torch >= 2.6
        with sdpa_kernel(order, set_priority=True):
            yield
    else:
        # Without priorities, enabling fewer backends is the only lever: the preferred one, the
        # memory-efficient kernel (it takes any head size) and the math path behind them.
        with sdpa_kernel(list(dict.fromkeys([order[0], _backend("efficient"), _backend("math")]))):
            yield


def sdpa_choice(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
) -> str:
    """The backend SDPA dispatches these inputs to under the flags in force: 'flash', 'efficient',
    'cudnn', 'math', or 'none' (no enabled backend takes them); 'unknown' where this torch cannot say."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    try:
        return BACKEND_NAMES.get(int(choose(q, k, v, attn_mask, 0.0, False)), "unknown")
    except RuntimeError:
        return "none"
