"""The diffusers family compiled from outside, as the native one is: the transformer's blocks
regionally and the VAE's decoder, warmed once per resolution bucket at start-up by internal
warm-up requests (the pipeline owns its loop), so that no request compiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ditfleet.compile import WarmupRuns, compile_count, prepare_worker_pipeline
from ditfleet.compile.config import CompileConfig
from ditfleet.model.family import model_family
from ditfleet.model.generation.pipeline import Sampling
from ditfleet.model.settings import PipelineSettings
from ditfleet.testing.diffusers_models import make_flux_dir

BUCKETS = ["32x32", "48x32"]
# Requests run at the text length warm-up ran (the actor passes both its pipeline setting).
TEXT_LENGTH = WarmupRuns().max_sequence_length


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    return make_flux_dir(tmp_path_factory.mktemp("flux") / "model")


def _pipe(flux_dir: Path):
    family = model_family(str(flux_dir))
    return family.load_pipeline(
        flux_dir,
        device="cpu",
        dtype=torch.float32,
        settings=PipelineSettings(),
        model_revision="r",
        batch_size=2,
    )


def test_blocks_and_decoder_compile_once_per_bucket_and_requests_never_compile(flux_dir):
    pipe = _pipe(flux_dir)
    # Dynamo's capture and guards as under inductor, without its minutes of C++ on a shared CPU:
    # aot_eager for the blocks; eager for the decoder, whose group norm after the mid-block
    # attention AOTAutograd's CPU path refuses (a strided input; inductor and eager take it).
    config = CompileConfig(
        vae=True, dit=True, vae_backend="eager", dit_backend="aot_eager", shared_cache=False
    )
    prepared = prepare_worker_pipeline(pipe, config, BUCKETS, runs=WarmupRuns(batch_sizes=(2,), steps=2))
    labels = set(prepared.compile.methods)
    assert {
        "vae.decoder.forward",
        "transformer_blocks.0.forward",
        "single_transformer_blocks.0.forward",
    } <= labels
    assert prepared.fallbacks == {}, prepared.fallbacks
    assert prepared.warmup is not None and [b.bucket for b in prepared.warmup.buckets] == BUCKETS
    assert all(b.compiles > 0 for b in prepared.warmup.buckets[:1])
    assert set(prepared.compile.status.values()) == {"compiled"}

    before = compile_count()
    for prompts, (w, h) in ((["a red circle"], (32, 32)), (["a fox", "blue square", "snow"], (48, 32))):
        inputs = pipe.encode_guidance(prompts, None, 1.0, TEXT_LENGTH)
        images = pipe.run(inputs, Sampling(h, w, 2, list(range(len(prompts))), 1.0)).images
        assert images.shape == (len(prompts), 3, h, w)
    assert compile_count() == before, "a request compiled: warm-up missed a shape"


def test_an_image_is_the_same_whichever_rows_share_its_batch(flux_dir):
    """Every batch runs padded to the actor's batch size, so a row's bytes do not depend on its
    neighbours (a retry, a resume or the gate regroups rows)."""
    pipe = _pipe(flux_dir)

    def image(prompts: list[str], seeds: list[int]) -> torch.Tensor:
        return pipe.run(
            pipe.encode_guidance(prompts, None, 1.0, TEXT_LENGTH), Sampling(32, 32, 2, seeds, 1.0)
        ).images[0]

    alone = image(["a red circle"], [5])
    assert torch.equal(alone, image(["a red circle", "a blue square"], [5, 9]))
    assert torch.equal(alone, image(["a red circle", "snow"], [5, 1]))
