"""The rotary embedding's compiled form: the same bits as the two-halves formula in fp32, and one
Inductor graph for every batch size and prompt length the node self-test sweeps (no recompile for
one-token prompts, which the stacked form cost under torch 2.11)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.compile.compiled_method import CompiledMethod
from ditfleet.compile.counting import count_compiles
from ditfleet.model.rope import RotaryTables, apply_rotary, rotate_pairs


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


class _Rotary:
    """What a DiT block's compiled region does with the text rotation: norm-free, RoPE only."""

    def rotate(self, x: torch.Tensor, rotation) -> torch.Tensor:
        return apply_rotary(x, rotation)


@pytest.mark.timeout(600)
def test_inductor_compiles_the_rotation_once_for_every_batch_and_prompt_length():
    # The self-test's sweep (--tiny): warmed at batch 4 and 8 tokens, then batches 1-4 at
    # lengths 1, 2, 3, 8, 16, text length and batch dynamic as the DiT block marks them.
    owner = _Rotary()
    compiled = CompiledMethod(
        owner,
        "rotate",
        {"backend": "inductor", "dynamic": False},
        dynamic_dims={0: (0, 1), 1: {"cos": (0,), "sin": (0,), "polar": (0,)}},
    )
    tables = RotaryTables((8, 12, 12))
    g = torch.Generator().manual_seed(1)

    def call(batch: int, length: int) -> None:
        _, rot = tables.tables((1, 4, 4), length, torch.device("cpu"))
        x = torch.randn(batch, length, 2, 32, generator=g)
        got = compiled(x, rot)
        torch.testing.assert_close(got, apply_rotary(x, rot), atol=1e-6, rtol=1e-6)

    with count_compiles() as warm:
        call(4, 8)
    assert warm.count == 1 and compiled.fallback_reason is None
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for batch in (1, 2, 3, 4):
            for length in (1, 2, 3, 8, 16):
                call(batch, length)
    assert tally.count == 0
    assert compiled.compiled_calls == 21 and compiled.fallback_reason is None
