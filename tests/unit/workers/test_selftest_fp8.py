"""The self-test's FP8 DiT (workers/selftest/parts.fp8_copy): the loaded DiT quantized beside it."""

from __future__ import annotations

import copy

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.loading.quantization import QuantizationError
from ditfleet.model.qwen_image.fp8 import Fp8Linear, quantize_model
from ditfleet.testing.outliers import forward_inputs, relative_error
from ditfleet.workers.selftest import parts
from ditfleet.workers.selftest.parts import fp8_copy


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("fp8", "fp8-weight-only"))
def test_fp8_copy_shares_the_kept_tensors_and_computes_the_in_place_quantization(mode):
    """The original untouched, its bf16-kept tensors shared rather than copied, the output the
    in-place quantization's; a method compiled onto the original does not leak into the copy."""
    dit = load_pipeline("tiny").transformer
    inputs = forward_inputs(dit, (4, 4), 8)
    with torch.inference_mode():
        exact = dit(**inputs)
    dit.forward = lambda *a, **k: pytest.fail("the copy called the original's installed method")
    fp8 = fp8_copy(dit, mode)
    del dit.forward
    reference = quantize_model(copy.deepcopy(dit), mode)
    with torch.inference_mode():
        got, want, again = fp8(**inputs), reference(**inputs), dit(**inputs)
    assert torch.equal(got, want) and torch.equal(again, exact)
    assert 0 < relative_error(got, exact) < 0.1
    assert isinstance(dit.transformer_blocks[0].attn.to_q, torch.nn.Linear)
    assert isinstance(fp8.transformer_blocks[0].attn.to_q, Fp8Linear)
    assert fp8.img_in.weight is dit.img_in.weight  # kept in the load dtype: the same tensor
    originals = {id(t) for t in dit.parameters()}
    for name, module in fp8.named_modules():
        if not isinstance(module, Fp8Linear):
            assert all(id(p) in originals for p in module.parameters(recurse=False)), name


def test_fp8_copy_is_none_where_the_device_cannot_run_the_mode(monkeypatch):
    def check_device(mode, device):
        if mode == "fp8":
            raise QuantizationError("no FP8 matrix units")

    dit = load_pipeline("tiny").transformer
    monkeypatch.setattr(parts, "check_device", check_device)
    assert fp8_copy(dit, "fp8") is None
    assert fp8_copy(dit, "fp8-weight-only") is not None
