"""An edit model warms up like a text one, and more: the VAE encode of its sources is a compiled
target (model.family's compile regions) and the warm-up encodes a source per row at every bucket
(compile.warmup), so a request whose source has the bucket's aspect ratio compiles nothing.

Traced with Dynamo's eager backend (the shapes and the graph breaks are Dynamo's; Inductor would
add minutes of code generation on 2 CPU cores and nothing this test asks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ditfleet.compile import CompileConfig, ResolutionBucket, apply_compile, warm_up
from ditfleet.compile.counting import compile_count
from ditfleet.compile.warmup import WarmupRuns
from ditfleet.model.family import load_pipeline
from ditfleet.testing.models import write_toy_edit_checkpoint


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["2509", "2511"])
def test_an_edit_request_after_warm_up_compiles_nothing(tmp_path, zero_cond_t):
    from PIL import Image

    pipe = load_pipeline(write_toy_edit_checkpoint(tmp_path / "m", zero_cond_t=zero_cond_t), "cpu")
    # Sources at a small area: the shapes are what matters here, not their size.
    pipe.edit = dataclasses.replace(pipe.edit, vae_area=128 * 128)
    config = CompileConfig(vae=True, dit=True, vae_backend="eager", dit_backend="eager")
    report = apply_compile(pipe, config)
    assert "vae.encode" in report.methods and "vae.decode" in report.methods
    bucket = ResolutionBucket(64, 48)
    warm = warm_up(pipe, [bucket], WarmupRuns(prompts=("a red circle",), steps=1))
    assert warm.compiles > 0 and report.status["vae.encode"] == "compiled"

    before = compile_count()
    source = Image.new("RGB", (256, 192), (10, 200, 30))  # the bucket's 4:3, another size
    out = pipe.generate(["a blue square"], sources=[[source]], height=48, width=64, steps=2, seeds=[3])
    assert compile_count() == before, "a request of a warmed bucket compiled"
    assert out.shape == (1, 3, 48, 64) and bool(torch.isfinite(out).all())
