"""How an fp8 GEMM applies its scales where the kernel refuses row-wise ones: torch 2.11's CPU
kernel (per-tensor scales only, found by probing it once), Hopper before CUDA 13 (large-K GEMMs,
decided from the build's version), and a refusal at run time (a build the rules do not know)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model.loading.quantization import ROWWISE_MAX_K_BEFORE_CUDA13, layer_scale_kind, rowwise_max_k
from ditfleet.model.qwen_image import fp8
from ditfleet.model.qwen_image.fp8 import Fp8Linear, gemm_support, probe_scaled_mm

REAL_KERNEL = torch._scaled_mm


def per_tensor_only(a, b, scale_a, scale_b, out_dtype):
    """torch 2.11's CPU kernel: an internal assert unless both scales are single numbers."""
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        raise RuntimeError(
            "(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED: "
            "Now _scaled_mm only supports per-tensor scaling for CPU backend."
        )
    return REAL_KERNEL(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def no_fp8_kernel(a, b, scale_a, scale_b, out_dtype):
    raise NotImplementedError("Could not run 'aten::_scaled_mm' with arguments from the 'CPU' backend")


def test_rowwise_limit_by_cuda_version_and_gpu():
    # Hopper before CUDA 13: large-K row-wise GEMMs are refused (pytorch/ao#4582)
    assert rowwise_max_k("12.9", (9, 0)) == ROWWISE_MAX_K_BEFORE_CUDA13 == 3072
    assert rowwise_max_k("12.6", (9, 0)) == 3072
    assert rowwise_max_k("13.0", (9, 0)) is None
    assert rowwise_max_k("12.9", (8, 9)) is None  # Ada: not affected
    assert rowwise_max_k(None, None) is None  # a CPU build
    assert rowwise_max_k("twelve", (9, 0)) == 3072  # unreadable: the safe side
    # per layer: Qwen-Image's MLP down-projection (K=12288) falls back, the 3072-wide ones do not
    assert layer_scale_kind("rowwise", 12288, 3072) == "tensorwise"
    assert layer_scale_kind("rowwise", 3072, 3072) == "rowwise"
    assert layer_scale_kind("rowwise", 12288, None) == "rowwise"
    assert layer_scale_kind("tensorwise", 64, None) == "tensorwise"
    assert layer_scale_kind("weight-only", 64, None) == "weight-only"
    with pytest.raises(ValueError, match="scale kind"):
        layer_scale_kind("blockwise", 64, None)


def test_probe_finds_what_the_cpu_kernel_takes():
    assert probe_scaled_mm("cpu", per_tensor_only) == "tensorwise"
    assert probe_scaled_mm("cpu", no_fp8_kernel) == "weight-only"
    assert probe_scaled_mm("cpu", REAL_KERNEL) in ("rowwise", "tensorwise")


def _layer(in_features: int = 64, out_features: int = 48) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(torch.nn.Linear(in_features, out_features).to(torch.bfloat16), "fp8")


def _x(in_features: int = 64) -> torch.Tensor:
    return torch.randn(2, 5, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_a_per_tensor_kernel_runs_the_same_quantization_and_a_missing_one_runs_weight_only(monkeypatch):
    layer, x = _layer(), _x()
    monkeypatch.setitem(fp8._GEMM_SUPPORT, "cpu", ("rowwise", None))
    rowwise = layer(x) if probe_scaled_mm("cpu") == "rowwise" else None

    monkeypatch.setattr(fp8, "_KERNEL", per_tensor_only)
    monkeypatch.delitem(fp8._GEMM_SUPPORT, "cpu")
    assert gemm_support("cpu") == ("tensorwise", None)  # probed once, then kept
    assert layer.scale_kind(x.device) == "tensorwise"
    tensorwise = layer(x)
    assert tensorwise.dtype == torch.bfloat16 and tensorwise.shape == (2, 5, 48)
    if rowwise is not None:  # the same product and scales: equal to bf16 rounding
        torch.testing.assert_close(tensorwise, rowwise, atol=2e-2, rtol=1e-2)
    exact = torch.nn.functional.linear(x.float(), layer.dequantized(torch.float32), layer.bias.float())
    assert float((tensorwise.float() - exact).norm() / exact.norm()) < 0.05

    monkeypatch.setattr(fp8, "_KERNEL", no_fp8_kernel)
    monkeypatch.setitem(fp8._GEMM_SUPPORT, "cpu", (probe_scaled_mm("cpu"), None))
    assert layer.scale_kind(x.device) == "weight-only"
    weight_only = layer(x)
    assert torch.equal(weight_only, torch.nn.functional.linear(x, layer.dequantized(x.dtype), layer.bias))


def test_check_device_decides_before_any_compile(monkeypatch):
    monkeypatch.setattr(fp8, "_KERNEL", per_tensor_only)
    monkeypatch.delitem(fp8._GEMM_SUPPORT, "cpu", raising=False)
    fp8.check_device("fp8", "cpu")
    assert fp8._GEMM_SUPPORT["cpu"] == ("tensorwise", None)


def test_a_rowwise_refusal_at_run_time_falls_back_for_that_k_and_above(monkeypatch):
    calls = []

    def refuses_large_k(a, b, scale_a, scale_b, out_dtype):
        rowwise = scale_a.numel() > 1
        calls.append((a.shape[1], rowwise))
        if rowwise and a.shape[1] >= 64:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return (
            per_tensor_only(a, b, torch.ones(()), torch.ones(()), torch.float32)
            .mul(scale_a * scale_b)
            .to(out_dtype)
        )

    monkeypatch.setattr(fp8, "_KERNEL", refuses_large_k)
    monkeypatch.setitem(fp8._GEMM_SUPPORT, "cpu", ("rowwise", None))
    wide, narrow = _layer(64), _layer(32)
    with pytest.warns(RuntimeWarning, match="K=64.*per-tensor"):
        y = wide(_x(64))
    assert fp8._GEMM_SUPPORT["cpu"] == ("rowwise", 63)
    assert calls == [(64, True), (64, False)]
    expected = wide._tensorwise(*fp8.quantize_rows(_x(64).reshape(-1, 64)), torch.bfloat16)
    assert torch.equal(y.reshape(-1, 48), expected + wide.bias.to(torch.bfloat16))
    calls.clear()
    wide(_x(64))
    narrow(_x(32))
    assert calls == [(64, False), (32, True)]  # no second refusal; the narrow layer stays row-wise


def test_fast_accumulation_is_passed_to_the_kernel_when_asked(monkeypatch):
    seen = []

    def recording(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
        seen.append(use_fast_accum)
        return REAL_KERNEL(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(fp8, "_KERNEL", recording)
    monkeypatch.setitem(fp8._GEMM_SUPPORT, "cpu", ("tensorwise", None))
    model = torch.nn.Sequential(_layer(), torch.nn.ReLU(), _layer(48, 16))
    x = _x()
    model(x)
    assert fp8.set_fast_accum(model, True) == 2
    model(x)
    assert seen == [False, False, True, True]
