"""fp32 linear layers through oneDNN on CPU: `use_onednn_linears(module)`.

On CPU, aten's fp32 `F.linear` goes to MKL's sgemm, which on some x86 CPUs (AMD's with
AVX-512, e.g. EPYC Zen 5) runs its AVX2 code path: half the machine's fp32 peak. oneDNN's fp32
matmul uses AVX-512 there and runs about twice as fast on the DiT's shapes (hidden 3072,
1,000+ tokens: 100 -> 200+ GFLOP/s per core), in full fp32 (no reduced-precision math). The
DiT is matmul-bound on CPU (94-98% of a forward), so this is where a compiled CPU forward gains.

Inductor's own oneDNN path (`freezing=True`) folds each weight into its graph as a constant
and prepacks it: every block would get its own graph (the compiled DiT shares one graph between
all blocks), and a weight changed after compile (a LoRA merged in place) would be ignored. Here
the weight stays an ordinary dense parameter read on every call, so both hold. The call is a
custom op (`ditfleet::onednn_linear`), which Inductor keeps as an opaque kernel call in its
graph (its oneDNN lowering accepts only constant weights).

Swapping is a class change of each `nn.Linear` (same parameters, same state dict, still an
nn.Linear for isinstance), undone by `restore_linears`. Inference only: the op has no backward.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


@torch.library.custom_op("ditfleet::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T + bias, by oneDNN; x of any rank >= 2 (batch dims kept)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose forward is `onednn_linear` (installed by class swap, never built)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:  # oneDNN wants a batch dim; nothing in the DiT calls it so
            return super().forward(input)
        return onednn_linear(input, self.weight, self.bias)


def onednn_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `use_onednn_linears` applies: fp32 on CPU with oneDNN built in. (bf16 on CPU
    already goes through oneDNN in aten.)"""
    return (
        torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def use_onednn_linears(module: nn.Module) -> int:
    """Route every plain fp32 CPU nn.Linear inside `module` through oneDNN; how many were swapped."""
    swapped = 0
    for m in module.modules():
        if type(m) is nn.Linear and onednn_available(m.weight.device, m.weight.dtype):
            m.__class__ = OneDNNLinear
            swapped += 1
    return swapped


def restore_linears(module: nn.Module) -> int:
    """Undo `use_onednn_linears`; how many were restored."""
    restored = 0
    for m in module.modules():
        if type(m) is OneDNNLinear:
            # m stops being a OneDNNLinear here, a change of type that mypy's narrowing cannot follow
            cast(nn.Module, m).__class__ = nn.Linear
            restored += 1
    return restored
