"""Warm-up traces the long prompt first (issue 50, lever 5): a compiled DiT's graphs are traced,
and Inductor's GEMMs tuned, at the first call's text length, which should be a realistic one."""

from __future__ import annotations

import pytest

from ditfleet.compile.warmup import WarmupRuns, warm_up
from ditfleet.model import load_pipeline


@pytest.mark.parametrize("with_text_encoder", [True, False], ids=["prompts", "embeddings"])
def test_the_first_warm_up_call_has_the_longest_text(with_text_encoder):
    pipe = load_pipeline("tiny", load_text_encoder_too=with_text_encoder)
    lengths: list[int] = []
    generate = pipe.generate

    def recording(**kwargs):
        lengths.append(kwargs["prompt_embeds"].shape[1])
        return generate(**kwargs)

    pipe.generate = recording
    warm_up(pipe, ["64x64"], WarmupRuns(steps=1))
    assert len(lengths) == 2 and lengths[0] == max(lengths) > lengths[1], lengths
