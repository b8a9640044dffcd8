"""The rotary embedding's compiled form: the same bits as the two-halves formula in fp32, and one
Inductor graph for every batch size and prompt length the node self-test sweeps (no recompile for
one-token prompts, which the stacked form cost under torch 2.11)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.compile.counting import count_compiles
from ditfleet.model.qwen_image.rope import RotaryTables, apply_rotary, rotate_pairs


def _stacked(xf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The textbook form: both halves computed, then stacked back into pairs."""
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_stack_free_rotation_is_bitwise_the_stacked_one_in_fp32(scale):
    tables = RotaryTables((8, 12, 12))
    img, txt = tables.tables((1, 6, 5), 7, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for rot in (img, txt):
        xf = torch.randn(3, rot.cos.shape[0], 2, 16, 2, generator=g) * scale
        assert torch.equal(rotate_pairs(xf, rot.cos, rot.sin), _stacked(xf, rot.cos, rot.sin))
    # and the eager complex path is the same rotation, to rounding
    x = torch.randn(2, txt.cos.shape[0], 2, 32, generator=g)
    xf = x.unflatten(-1, (-1, 2))
    torch.testing.assert_close(apply_rotary(x, txt), rotate_pairs(xf, txt.cos, txt.sin).flatten(-2))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_inductor_compiles_the_dit_block_once_for_every_batch_and_prompt_length():
    # The node self-test's sweep (--tiny), on the DiT block regions as the worker compiles them
    # with Inductor: warmed at batch 4 and 8 tokens, then batches 1-4 at lengths 1, 2, 3, 8, 16,
    # padded batches included. Under torch 2.11 the stacked rotation cost a recompile for
    # one-token prompts (Inductor's cat lowering guards the text length against 1); 2.13 does not
    # guard, so this holds the rehearsal's finding (docs/real-model.md) on both. In bf16, the
    # dtype of the GPU path and the self-test: under 2.11 an fp32 compiled DiT still guards the
    # text length against 1 (the rotation's fp32 result is then a view into the cat, not a cast).
    from ditfleet.compile.config import CompileConfig
    from ditfleet.compile.policy import apply_compile
    from ditfleet.model.generation.sampling import latent_grid
    from ditfleet.model.qwen_image.loader import load_pipeline

    pipe = load_pipeline("tiny", dtype=torch.bfloat16, load_text_encoder_too=False)
    config = CompileConfig(
        vae=False, dit=True, shared_cache=False, dit_backend="inductor", cpu_onednn_linear=False
    )
    report = apply_compile(pipe, config)
    dit = pipe.transformer
    h, w = latent_grid(64, 64)
    g = torch.Generator().manual_seed(7)
    x4 = torch.randn(4, h * w, 64, generator=g).bfloat16()
    t = torch.full((1,), 0.5, dtype=torch.bfloat16)

    def call(batch: int, length: int) -> None:
        text = torch.randn(batch, length, dit.config.joint_attention_dim, generator=g).bfloat16()
        mask = None
        if batch > 1 and length > 1:
            mask = torch.ones(batch, length, dtype=torch.long)
            mask[-1, length // 2 :] = 0
        with torch.no_grad():
            dit(x4[:batch], text, mask, t, [[(1, h, w)]] * batch)

    with count_compiles() as warm:
        call(4, 8)
    assert warm.count == 2 and report.fallbacks == {}
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for batch in (1, 2, 3, 4):
            for length in (1, 2, 3, 8, 16):
                call(batch, length)
    assert tally.count == 0 and report.fallbacks == {}
