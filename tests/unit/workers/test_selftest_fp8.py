"""The self-test's FP8 DiT (workers/selftest/parts.fp8_copy): the loaded DiT quantized beside it."""

from __future__ import annotations

import copy

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.loading.quantization import QuantizationError
from ditfleet.model.qwen_image.fp8 import Fp8Linear, quantize_model
from ditfleet.testing.outliers import forward_inputs, relative_error
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
    import ditfleet.model.qwen_image.fp8 as fp8  # the family's check, which parts asks through the face

    monkeypatch.setattr(fp8, "check_device", check_device)
    assert fp8_copy(dit, "fp8") is None
    assert fp8_copy(dit, "fp8-weight-only") is not None


def test_fp8_copy_takes_the_layer_set():
    """The default set keeps every block's img_mlp.net.2 in the load dtype (shared with the
    original); 'all' quantizes it."""
    dit = load_pipeline("tiny").transformer
    safe, every = fp8_copy(dit, "fp8"), fp8_copy(dit, "fp8", "all")
    for i, block in enumerate(dit.transformer_blocks):
        assert safe.transformer_blocks[i].img_mlp.net[2].weight is block.img_mlp.net[2].weight
        assert isinstance(every.transformer_blocks[i].img_mlp.net[2], Fp8Linear)
        assert isinstance(safe.transformer_blocks[i].txt_mlp.net[2], Fp8Linear)


def test_the_dit_lines_forwards_compute_the_modulation_every_call(tmp_path):
    """Each timed call passes its own timestep: the modulation cache serves none of them, so the
    DiT lines ('modulation': 'computed each forward') time what a request's forward computes."""
    from ditfleet.workers.selftest.speed import MODULATION, dit_call
    from tests.unit.workers.test_selftest import _tiny_context

    ctx = _tiny_context(tmp_path, "--text-len", "8")
    dit = load_pipeline("tiny").transformer.to(ctx.dtype)
    call, _ = dit_call(ctx, dit.config, 64)
    computed = []
    hooks = [
        b.img_mod[1].register_forward_hook(lambda *_: computed.append(1)) for b in dit.transformer_blocks
    ]
    for mode in ("cfg", "table"):
        dit.modulation_cache.set_mode(mode)
        computed.clear()
        with torch.no_grad():
            for _ in range(3):
                call(dit)
        assert len(computed) == 3 * len(dit.transformer_blocks), mode
    for h in hooks:
        h.remove()
    assert MODULATION == "computed each forward"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_tiny_rehearsal_compiles_each_fp8_layer_set(tmp_path):
    """fp8_compiled (--extra) rehearsed on the CPU: one measured line per layer set, each with its
    error against the bf16 output and the bf16 compiled figure it is compared with left as it was."""
    from tests.unit.workers.test_selftest import run_selftest

    code, lines = run_selftest(
        tmp_path / "out", "--only", "dit_compiled,fp8_compiled", "--extra", "fp8_compiled", timeout=380
    )
    fp8 = [x for x in lines if x["stage"] == "fp8_compiled"]
    assert code == 0 and {x["fp8_layers"] for x in fp8} == {"safe", "all"}, lines
    for x in fp8:
        assert x["status"] == "measured" and x["modulation"] == "computed each forward", x
        assert 0 < x["rel_err_vs_bf16"] < 0.2 and x["ms_per_forward"] > 0, x
    scales = {x["fp8_layers"]: sum(x["gemm_scales"].values()) for x in fp8}
    assert scales["all"] - scales["safe"] == 4  # the tiny DiT's 4 blocks: img_mlp.net.2 each
