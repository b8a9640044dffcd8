"""Shared pytest set-up. Fixtures live in their own modules, registered here."""

import os

# Tests run on 2 CPU cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.fixtures_s3",
    "tests.fixtures_ray",
]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A tiny random-weight Qwen-Image model in the diffusers layout, written by diffusers."""
    from tests.model_fixtures import add_tiny_text_encoder, make_diffusers_model_dir

    return add_tiny_text_encoder(make_diffusers_model_dir(tmp_path_factory.mktemp("random-model")))
