"""CPU proxies of the GPU hot path: the layout SDPA receives, the copies of a block, the backend switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ditfleet.model.generation.attention_backend import (
    ATTENTION_BACKENDS,
    attention_backend,
    backend_order,
    sdpa_choice,
)
from ditfleet.model.qwen_image.attention import TextPadding
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.qwen_image.vae_blocks import AttentionBlock


def test_vae_attention_hands_sdpa_dense_qkv_and_computes_what_the_strided_form_did():
    torch.manual_seed(0)
    block = AttentionBlock(24).eval()
    assert block.dense_qkv is None  # dense on CUDA; views on the CPU, whose images stay as they were
    block.dense_qkv = True  # what a CUDA run hands SDPA, checked here on the CPU
    x = torch.randn(2, 24, 6, 5)
    seen = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return original(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            got = block(x)
    finally:
        F.scaled_dot_product_attention = original
    ((q, k, v),) = seen
    for t in (q, k, v):
        assert t.shape == (2, 1, 30, 24)
        assert t.stride(-1) == 1 and t.stride(-2) == 24  # (B, heads, L, D), channels last and dense
        assert t[0].is_contiguous()
    # the form before: views of the conv output, stride H*W along channels
    with torch.no_grad():
        b, c, h, w = x.shape
        qkv = block.to_qkv(block.norm(x)).reshape(b, 1, 3 * c, h * w).transpose(-1, -2)
        rq, rk, rv = qkv.chunk(3, dim=-1)
        out = original(rq, rk, rv).squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        want = x + block.proj(out)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert sdpa_choice(q, k, v) in ("flash", "efficient", "cudnn", "math")


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy ops (cat, clone, copy_) under the mode."""

    OPS = {
        "cat": torch.ops.aten.cat.default,
        "clone": torch.ops.aten.clone.default,
        "copy_": torch.ops.aten.copy_.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {k: 0 for k in self.OPS}
        self.calls = {k: 0 for k in self.OPS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for name, op in self.OPS.items():
            if func is op:
                t = out if name != "copy_" else args[0]
                self.bytes[name] += t.numel() * t.element_size()
                self.calls[name] += 1
        return out


def test_the_copies_of_one_block_are_counted():
    cfg = TransformerConfig(
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(0)
    model = QwenImageTransformer(cfg).eval()
    B, N, L, D = 2, 16, 5, cfg.inner_dim
    img, txt = torch.randn(B, N, D), torch.randn(B, L, D)
    temb = torch.randn(1, D)
    rope = model.rope.tables((1, 4, 4), L, img.device)
    padding = TextPadding.build(None, B, L, N)
    block = model.transformer_blocks[0]
    with torch.no_grad(), CopyCounter() as counter:
        block(img, txt, temb, padding, rope)
    S, e = N + L, 4
    # q, k and v are each one cat of the two streams (3 x B*S*D), the attention output is cloned
    # into two dense per-stream tensors (B*S*D): the copies a fused two-stream layout would avoid.
    assert counter.calls["cat"] == 3 and counter.bytes["cat"] == 3 * B * S * D * e
    assert counter.calls["clone"] == 2 and counter.bytes["clone"] == B * S * D * e
    assert counter.calls["copy_"] == 0


def test_attention_backend_preference_is_cuda_only_and_keeps_a_fallback():
    assert ATTENTION_BACKENDS == ("auto", "cudnn", "flash", "efficient", "math")
    assert backend_order("cudnn") == ["cudnn", "flash", "efficient", "math"]
    assert backend_order("efficient")[0] == "efficient" and len(backend_order("efficient")) == 4
    for pref in ATTENTION_BACKENDS:
        with attention_backend(pref, "cpu"):
            q = torch.randn(1, 1, 4, 8)
            F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match="attention backend"):
        attention_backend("fast", "cuda")


def test_the_pipeline_applies_its_attention_backend(monkeypatch):
    import ditfleet.model.generation.pipeline as pipeline_module
    from ditfleet.model.settings import PipelineSettings

    seen = []
    real = pipeline_module.attention_backend
    monkeypatch.setattr(pipeline_module, "attention_backend", lambda p, d: seen.append((p, d)) or real(p, d))
    assert PipelineSettings().attention_backend == "auto"
    with pytest.raises(ValueError):
        PipelineSettings(attention_backend="fast")
    from ditfleet.model.qwen_image.loader import load_pipeline

    pipe = load_pipeline("tiny", attention_backend="cudnn", load_text_encoder_too=False)
    embeds = torch.randn(1, 3, pipe.transformer.config.joint_attention_dim)
    pipe.generate(prompt_embeds=embeds, height=32, width=32, steps=1, true_cfg_scale=1.0, seeds=[0])
    assert seen == [("cudnn", "cpu")]
