"""The memory plan of an edit (model/memory/plan.py, the Qwen-Image family's QwenImageMemory): each
source's latent tokens in every DiT forward and its VAE encode, a phase of its own; the estimates
against the CPU allocator's measured peak on real-width slices (tests/support/memory_measure)."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model.loading.weights import read_config
from ditfleet.model.memory import GB, Runtime, largest_batch, plan_memory
from ditfleet.model.qwen_image.memory_activations import dit_activation_bytes, vae_encode_activation_bytes
from ditfleet.model.qwen_image.memory_model import QwenImageMemory
from ditfleet.model.qwen_image.published import PUBLISHED
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.qwen_image.vae import QwenImageVAE, VAEConfig
from tests.support.memory_measure import peak_allocated_bytes

QWEN = PUBLISHED / "qwen-image"
TOLERANCE = 0.10  # as tests/unit/driver/test_memory_plan.py: allocator rounding, small temporaries


@pytest.fixture(scope="module")
def qwen() -> QwenImageMemory:
    return QwenImageMemory.from_dir(QWEN, name="Qwen-Image-Edit")


def _plan(model, sources=(), gb=None, **kwargs):
    run = Runtime(text_encoder="cpu")
    return plan_memory(
        model, height=1024, width=1024, batch=1, run=run, gpu_memory_gb=gb, sources=sources, **kwargs
    )


def test_a_source_of_the_targets_size_denoises_like_a_target_of_twice_the_tokens(qwen):
    text, edit = _plan(qwen), _plan(qwen, sources=[(1024, 1024)])
    # 1024x1024 target + one source encoded at 1024x1024: 8,192 image tokens, a 2048x1024 text job's
    wide = plan_memory(qwen, height=1024, width=2048, batch=1, run=Runtime(text_encoder="cpu"))
    assert edit.activations["denoise"] == wide.activations["denoise"] > text.activations["denoise"]
    # the source's encode is a phase of its own; a text job has none
    assert "source_encode" not in text.phases and edit.activations["source_encode"] > 0
    assert edit.activations["source_encode"] == vae_encode_activation_bytes(qwen.vae, 1, 1024, 1024, 2)
    # any source is encoded at the VAE's area: a 4000x3000 photo costs what a 1184x896 one does (4:3 at 1024x1024's area)
    assert _plan(qwen, sources=[(4000, 3000)]).activations == _plan(qwen, sources=[(1184, 896)]).activations
    assert edit.sources == ((1024, 1024),) and edit.to_dict()["sources"] == ["1024x1024"]
    assert "x1 with 1 source each bf16" in edit.describe()


def test_two_sources_cost_more_memory_and_a_smaller_batch(qwen):
    one, two = _plan(qwen, sources=[(1024, 1024)]), _plan(qwen, sources=[(1024, 1024)] * 2)
    assert two.activations["denoise"] > one.activations["denoise"]
    # the sources are encoded one at a time over the batch's rows: the larger one's peak
    assert two.activations["source_encode"] == one.activations["source_encode"]
    run = Runtime(text_encoder="cpu")
    text_batch = largest_batch(qwen, 80, height=1024, width=1024, run=run)
    edit_batch = largest_batch(qwen, 80, height=1024, width=1024, run=run, sources=[(1024, 1024)] * 2)
    assert 0 < edit_batch < text_batch
    # FP8's transient codes cover the source tokens too
    fp8 = Runtime(text_encoder="cpu", quantization="fp8")
    d = qwen.transformer.inner_dim

    def extra(p) -> int:
        tokens = 4096 * len(p.sources)
        bf16 = dit_activation_bytes(
            qwen.transformer, 1, 1024, 1024, p.text_len, 2, device="cuda", source_tokens=tokens
        )
        return p.activations["denoise"] - bf16

    edit_fp8 = plan_memory(qwen, height=1024, width=1024, batch=1, run=fp8, sources=[(1024, 1024)])
    assert extra(edit_fp8) == 2 * 4096 * 4 * d
    assert edit_fp8.peak < 80 * GB


@pytest.mark.slow
def test_vae_encode_estimate_matches_measured_peak_at_full_width():
    config = VAEConfig.from_dict(read_config(QWEN / "vae"))
    with torch.device("meta"):
        vae = QwenImageVAE(config, with_encoder=True)
    vae = vae.to_empty(device="cpu").eval().requires_grad_(False)
    for p in vae.parameters():
        torch.nn.init.normal_(p, std=0.02)

    def encode() -> None:
        with torch.no_grad():
            vae.encode(torch.randn(1, 3, 256, 256))  # made inside: the caller's image counts

    encode()
    measured = peak_allocated_bytes(encode)
    estimate = vae_encode_activation_bytes(config, 1, 256, 256, 4)
    assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate)


@pytest.mark.slow
def test_dit_estimate_with_source_tokens_matches_measured_peak_on_a_real_width_block():
    """One published-width block, a 256x256 target and a 256x256 source's 256 tokens, fp32."""
    config = TransformerConfig.from_dict({**read_config(QWEN / "transformer"), "num_layers": 1})
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    model = model.to_empty(device="cpu").eval().requires_grad_(False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    text_len, grid = 64, (16, 16)

    def forward() -> None:
        latents = torch.randn(1, 2 * grid[0] * grid[1], 64)  # the target's then the source's
        text = torch.randn(1, text_len, 3584)
        mask = torch.ones(1, text_len, dtype=torch.long)
        with torch.no_grad():
            model(latents, text, mask, torch.tensor([0.5]), [[(1, *grid), (1, *grid)]])

    forward()
    measured = peak_allocated_bytes(forward)
    estimate = dit_activation_bytes(config, 1, 256, 256, text_len, 4, source_tokens=256)
    assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate)
