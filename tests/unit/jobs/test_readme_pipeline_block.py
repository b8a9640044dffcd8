"""README's "the model alone" block runs as written and gives a PIL image."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.support.readme_blocks import readme_blocks


@pytest.mark.slow  # the tiny model loads and makes an image: about 2 s idle
def test_the_readme_model_block_runs_as_written_and_gives_a_pil_image():
    blocks = readme_blocks("Using it from Python")
    assert len(blocks) == 2 and "load_pipeline" in blocks[1]
    scope: dict = {}
    exec(compile(blocks[1], "README.md (the model alone)", "exec"), scope)  # noqa: S102 - the README's own code
    assert tuple(scope["images"].shape) == (1, 3, 128, 128)
    image = scope["image"]
    assert isinstance(image, Image.Image) and image.size == (128, 128) and image.mode == "RGB"
    # The pixels a job stores: diffusers' rounding of the clamped float image.
    expected = (scope["images"][0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    assert (expected == np.asarray(image)).all()
