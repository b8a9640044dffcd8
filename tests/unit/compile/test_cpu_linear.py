"""fp32 linears through oneDNN on CPU (compile.cpu_linear): same results as aten's, compiled by
Inductor with dynamic shapes, weights changed in place after compile are used, and apply_compile
installs them only with the DiT compiled on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ditfleet.compile import CompileConfig, apply_compile, remove_compile
from ditfleet.compile.cpu_linear import OneDNNLinear, onednn_available, restore_linears, use_onednn_linears
from ditfleet.model import load_pipeline

pytestmark = pytest.mark.skipif(not onednn_available("cpu", torch.float32), reason="this torch has no oneDNN")


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False)).eval()


def test_onednn_linears_match_aten_and_swap_back():
    model = _mlp()
    x = torch.randn(3, 17, 48)
    with torch.no_grad():
        expected = model(x)
        assert use_onednn_linears(model) == 2
        assert all(type(m) is OneDNNLinear for m in (model[0], model[2]))
        assert isinstance(model[0], nn.Linear), "LoRA matching finds them as nn.Linear"
        got = model(x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert use_onednn_linears(model) == 0, "idempotent"
        assert restore_linears(model) == 2 and type(model[0]) is nn.Linear
    assert not onednn_available("cpu", torch.bfloat16) and not onednn_available("meta", torch.float32)


@pytest.mark.slow
def test_inductor_keeps_them_dynamic_and_reads_the_live_weight():
    """One graph for every batch and length; a weight changed in place (a LoRA merged after
    compile) is used at once: the weight is an input of the graph, not a folded constant."""
    torch.manual_seed(1)
    # Linears only: the graph is all kernel calls, so Inductor builds no C++ (seconds, not minutes).
    model = nn.Sequential(nn.Linear(48, 96), nn.Linear(96, 40, bias=False)).eval()
    use_onednn_linears(model)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)

    compiled = torch.compile(lambda m, x: m(x), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch, length in ((2, 5), (4, 33)):
            x = torch.randn(batch, length, 48)
            torch.testing.assert_close(compiled(model, x), reference(x), rtol=1e-5, atol=1e-5)
        model[0].weight.add_(0.5)
        x = torch.randn(3, 9, 48)
        torch.testing.assert_close(compiled(model, x), reference(x), rtol=1e-5, atol=1e-5)


def test_apply_compile_uses_them_only_for_a_compiled_dit_on_cpu(random_model_dir):
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False)
    linears = [m for m in pipe.transformer.modules() if isinstance(m, nn.Linear)]

    def kinds() -> set[type]:
        return {type(m) for m in linears}

    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    assert kinds() == {OneDNNLinear}
    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager", cpu_onednn_linear=False))
    assert kinds() == {nn.Linear}
    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    remove_compile(pipe)
    assert kinds() == {nn.Linear}
    apply_compile(pipe, CompileConfig(vae=False, dit=False))
    assert kinds() == {nn.Linear}
    on, off = (CompileConfig(dit=True, cpu_onednn_linear=v).describe("cpu") for v in (True, False))
    assert on["dit_linear"] == "onednn" and off["dit_linear"] == "aten", "part of the cache key"
    assert "dit_linear" not in CompileConfig(dit=True).describe("cuda")
