"""The compiled DiT with FP8 weights: one graph pair per bucket, then no recompile for any prompt
length or batch size; compiled equals eager; the modulation cache still computes each block's
modulation once per step, and its images equal the uncached ones bit for bit. (Inductor on the
FP8 DiT: test_dit_compile.py's Inductor test, parametrized by quantization.)"""

from __future__ import annotations

import pytest
import torch

from ditfleet.compile import CompileConfig, WarmupRuns, apply_compile, count_compiles, warm_up
from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.fp8 import Fp8Linear
from tests.support.compile_helpers import SMALL_BUCKETS, generate
from tests.unit.compile.test_dit_compile import _inputs

BATCH_SIZE = 2
LENGTHS = (1, 7, 300)
MODES = ("fp8", "fp8-weight-only")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fp8_dit_warms_once_per_bucket_and_never_recompiles(random_model_dir, mode):
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False, quantization=mode)
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, Fp8Linear)
    report = apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    warm = warm_up(pipe, SMALL_BUCKETS, WarmupRuns(batch_sizes=(BATCH_SIZE,)))
    assert warm.compiles == 2 * len(SMALL_BUCKETS)
    assert set(report.status.values()) == {"compiled"} and report.fallbacks == {}

    eager = load_pipeline(random_model_dir, load_text_encoder_too=False, quantization=mode)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for bucket in SMALL_BUCKETS:
            for batch in range(1, BATCH_SIZE + 1):
                for i, length in enumerate(LENGTHS):
                    inputs = _inputs(pipe, batch, length, seed=i, padded=i % 2 == 0)
                    image = generate(pipe, bucket, inputs, seeds=range(batch), steps=1)
                    assert image.shape == (batch, 3, bucket.height, bucket.width)
                    if batch == 2 and length == 300:
                        expected = generate(eager, bucket, inputs, seeds=range(batch), steps=1)
                        torch.testing.assert_close(image, expected, atol=1e-4, rtol=0)
    assert tally.count == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_modulation_cache_with_fp8_weights(random_model_dir, mode):
    """img_mod.1 is an FP8 layer: still called as a module, once per block per step with the
    cache (two CFG passes), and the cached images equal the uncached ones exactly."""
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False, quantization=mode)
    uncached = load_pipeline(
        random_model_dir, load_text_encoder_too=False, quantization=mode, modulation_cache="off"
    )
    assert isinstance(pipe.transformer.transformer_blocks[0].img_mod[1], Fp8Linear)
    calls = []
    hooks = [
        b.img_mod[1].register_forward_hook(lambda *_: calls.append(1))
        for b in pipe.transformer.transformer_blocks
    ]
    inputs = _inputs(pipe, 2, 5, 0, True)
    try:
        image = generate(pipe, SMALL_BUCKETS[0], inputs, seeds=(1, 2))
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 2 * len(pipe.transformer.transformer_blocks)  # 2 steps, once per step
    assert torch.equal(image, generate(uncached, SMALL_BUCKETS[0], inputs, seeds=(1, 2)))
