"""Shared pytest set-up. Fixtures live in their own modules, registered here."""

import os

# Tests run on 2 CPU cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.support.fixtures_s3",
    "tests.support.fixtures_ray",
]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A tiny random-weight Qwen-Image model in the diffusers layout, written by diffusers."""
    from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir

    return add_tiny_text_encoder(make_diffusers_model_dir(tmp_path_factory.mktemp("random-model")))


@pytest.fixture(scope="session")
def real_widths_dir(tmp_path_factory):
    """Qwen-Image's published layout cut to one block (hidden 3072, text 3584, the full VAE), random
    bf16 weights in four hub-style shards + index (ditfleet/testing/real_widths.py); about 1 GB on disk."""
    from ditfleet.testing.real_widths import write_real_widths_checkpoint

    return write_real_widths_checkpoint(tmp_path_factory.mktemp("real-widths") / "qwen-image", num_layers=1)


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test: `torch_threads(2)`. The count is process-wide,
    so it is put back afterwards rather than leaking into every later test of the session."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
