"""The true-CFG rule and the default negative prompt (model.generation.guidance), and the pipeline's use of
them: text prompts without a negative get the default, a null negative or a scale <= 1 turns
CFG off, and text and embeddings are not mixed across the two branches."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model.generation.guidance import DEFAULT_NEGATIVE_PROMPT, cfg_on, negative_text, negative_texts


@pytest.mark.parametrize(
    "scale, has_negative, on",
    [
        (4.0, True, True),
        (1.0, True, False),  # scale 1: the conditional velocity alone
        (0.5, True, False),
        (4.0, False, False),  # no negative: nothing to guide against
        ([4.0, 2.0], True, True),
        ([4.0, 1.0], True, False),  # one batch runs CFG for all of its rows or for none
    ],
)
def test_cfg_on(scale, has_negative, on):
    assert cfg_on(scale, has_negative) is on


def test_negative_texts_default_and_per_prompt():
    assert DEFAULT_NEGATIVE_PROMPT == " "
    assert negative_text(None) == negative_text("") == DEFAULT_NEGATIVE_PROMPT
    assert negative_text("blurry") == "blurry"
    assert negative_texts(2, None) == [" ", " "]
    assert negative_texts(2, "blurry") == ["blurry", "blurry"]
    assert negative_texts(3, ["a", None, ""]) == ["a", " ", " "]
    with pytest.raises(ValueError, match="need one negative prompt per prompt: 2 prompts, 1 negatives"):
        negative_texts(2, ["a"])


@pytest.fixture(scope="module")
def tiny_pipe():
    from ditfleet.model import load_pipeline

    return load_pipeline("tiny", "cpu", torch.float32, load_text_encoder_too=True)


def test_encode_guidance_follows_the_rule(tiny_pipe):
    prompts = ["a small red circle", "a large green square at the centre"]
    on = tiny_pipe.encode_guidance(prompts, None, 4.0, 64)
    default, _ = tiny_pipe.encode_prompt([DEFAULT_NEGATIVE_PROMPT], 64)
    assert on["negative_prompt_embeds"].shape[0] == 2
    assert torch.equal(on["negative_prompt_embeds"][1], default[0])  # the shared default, encoded once
    mixed = tiny_pipe.encode_guidance(prompts, ["blurry", None], 4.0, 64)
    blurry, _ = tiny_pipe.encode_prompt(["blurry", " "], 64)
    assert torch.allclose(mixed["negative_prompt_embeds"][:, : blurry.shape[1]], blurry, atol=1e-6)
    off = tiny_pipe.encode_guidance(prompts, "blurry", 1.0, 64)
    assert off["negative_prompt_embeds"] is None and off["negative_prompt_embeds_mask"] is None


@pytest.mark.slow
def test_generate_text_path_is_encode_guidance(tiny_pipe):
    kw = dict(height=32, width=32, steps=1, true_cfg_scale=4.0, seeds=[3, 4])
    prompts = ["a small red circle", "a blue square"]
    from_text = tiny_pipe.generate(prompts, "blurry", **kw)
    from_embeds = tiny_pipe.generate(**tiny_pipe.encode_guidance(prompts, "blurry", 4.0), **kw)
    assert torch.equal(from_text, from_embeds)
    no_guidance = tiny_pipe.generate(prompts, "blurry", **{**kw, "true_cfg_scale": 1.0})
    assert not torch.equal(from_text, no_guidance)


def test_generate_refuses_text_and_embeddings_across_branches(tiny_pipe):
    embeds, mask = tiny_pipe.encode_prompt(["a red circle"], 64)
    kw = dict(height=32, width=32, steps=1, seeds=[0])
    with pytest.raises(ValueError, match="negative_prompt \\(text\\) with prompt"):
        tiny_pipe.generate(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt="blurry", **kw)
    with pytest.raises(ValueError, match="negative_prompt_embeds with prompt_embeds"):
        tiny_pipe.generate(["a red circle"], negative_prompt_embeds=embeds, **kw)
