"""Issue 50, lever 5: the DiT's image q/k/v as one GEMM (weights fused at load, the
checkpoint's names and state dict unchanged, LoRA and FP8 still working) and no clone between
the attention kernel and the output projections. Outputs equal the unfused DiT's within fp32
rounding (bit for bit on this CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.lora import LayerUpdate, merge_updates

CASES = [(1, 7, None), (2, 9, [9, 5]), (3, 9, [9, 9, 4])]  # batch, text length, real tokens per row


def _inputs(transformer, batch: int, text_len: int, real, seed: int = 0) -> tuple:
    cfg, g = transformer.config, torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 64, cfg.in_channels, generator=g).to(transformer.dtype)
    e = torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g).to(transformer.dtype)
    mask = None
    if real is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(real)[:, None]).long()
    return x, e, mask, torch.full((1,), 0.5), [(1, 8, 8)] * batch


def _forward(transformer, *args) -> torch.Tensor:
    with torch.no_grad():
        return transformer(*args)


@pytest.fixture(scope="module")
def fused_and_not():
    """The tiny DiT as the loader leaves it (fused), and a copy put back to three GEMMs."""
    fused = load_pipeline("tiny", load_text_encoder_too=False).transformer
    unfused = copy.deepcopy(fused)
    unfused.fuse_qkv(on=False)
    return fused, unfused


def test_the_loader_fuses_qkv_without_a_second_copy_of_any_weight(fused_and_not):
    fused, unfused = fused_and_not
    attn = fused.transformer_blocks[0].attn
    assert attn.qkv_fused and not unfused.transformer_blocks[0].attn.qkv_fused
    # the three Linears' weights are row blocks of the fused weight: one storage
    qkv = attn.__dict__["_img_qkv"]
    D = attn.to_q.weight.shape[0]
    assert attn.to_k.weight.data_ptr() == qkv.weight.data_ptr() + D * D * qkv.weight.element_size()
    assert attn.to_v.bias.data_ptr() == qkv.bias[2 * D :].data_ptr()
    # the checkpoint's names and values, the same parameter count (the fused layer is no submodule)
    a, b = fused.state_dict(), unfused.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in unfused.parameters())


@pytest.mark.parametrize(("batch", "text_len", "real"), CASES)
def test_fused_outputs_equal_the_unfused_ones(fused_and_not, batch, text_len, real):
    fused, unfused = fused_and_not
    args = _inputs(fused, batch, text_len, real)
    a, b = _forward(fused, *args), _forward(unfused, *args)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_lora_merged_into_the_fused_dit_reaches_its_gemm(fused_and_not):
    """merge_updates adds into to_q's weight in place: the fused GEMM sees it, as three would."""
    fused, unfused = (copy.deepcopy(t) for t in fused_and_not)
    fused.fuse_qkv()  # a deep copy keeps the views apart: fuse the copy again
    D, g = fused.config.inner_dim, torch.Generator().manual_seed(3)
    update = LayerUpdate(
        "transformer_blocks.0.attn.to_k",
        torch.randn(2, D, generator=g),
        torch.randn(D, 2, generator=g),
        None,
        0.5,
        "t",
    )
    args = _inputs(fused, 2, 9, [9, 5])
    before = _forward(fused, *args)
    merge_updates(fused, [update])
    merge_updates(unfused, [update])
    after = _forward(fused, *args)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, _forward(unfused, *args), rtol=1e-5, atol=1e-6)


def test_a_dtype_conversion_fuses_again(fused_and_not):
    fused, unfused = (copy.deepcopy(t) for t in fused_and_not)
    fused, unfused = fused.to(torch.bfloat16), unfused.to(torch.bfloat16)
    attn = fused.transformer_blocks[1].attn
    assert attn.qkv_fused and attn.to_q.weight.data_ptr() == attn.__dict__["_img_qkv"].weight.data_ptr()
    args = _inputs(fused, 2, 9, [9, 5])
    torch.testing.assert_close(_forward(fused, *args), _forward(unfused, *args), rtol=1.6e-2, atol=1e-2)


def test_fp8_layers_keep_their_own_gemms(random_model_dir):
    pipe = load_pipeline(random_model_dir, quantization="fp8", load_text_encoder_too=False)
    attn = pipe.transformer.transformer_blocks[0].attn
    assert not attn.qkv_fused and type(attn.to_q).__name__ == "Fp8Linear"
    out = _forward(pipe.transformer, *_inputs(pipe.transformer, 2, 9, [9, 5]))
    assert torch.isfinite(out).all()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("batch", "text_len", "real"), CASES)
def test_no_clone_between_attention_and_the_output_projections(fused_and_not, batch, text_len, real):
    """Unpadded, split by text length or one trailing pad: the attention output is written in
    the layout the output projections read (before: two clones per block)."""
    fused, _ = fused_and_not
    with _Ops() as seen:
        _forward(fused, *_inputs(fused, batch, text_len, real))
    assert "aten.clone.default" not in seen.ops
