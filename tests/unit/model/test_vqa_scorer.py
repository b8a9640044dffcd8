"""The vqa scorer (model.quality.vqa): VQAScore from the pipeline's own Qwen2.5-VL, on a tiny
random Qwen2.5-VL and a tokenizer built in the test (nothing fetched). Probabilities in [0, 1],
the same image scores the same alone or in any batch, the number is P("Yes") over the full
vocabulary, and prompt encoding is unchanged by scoring with the same model. The preprocessing
(model.quality.qwen_vision_input) is checked against transformers' Qwen2-VL image processor."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from ditfleet.model.quality import ScorerInputs, scorer  # noqa: E402
from ditfleet.model.quality.qwen_vision_input import (  # noqa: E402
    IMAGE_MEAN,
    IMAGE_STD,
    VisionLayout,
    vision_input,
)
from ditfleet.model.quality.vqa import VQAScore  # noqa: E402
from ditfleet.model.qwen_image.qwen_vision_size import MAX_PIXELS, MIN_PIXELS  # noqa: E402
from ditfleet.model.qwen_image.text_encoder import QwenVLTextEncoder  # noqa: E402
from tests.support.qwen_text_encoder import make_text_encoder, make_tokenizer  # noqa: E402

PROMPTS = ["a red cube", "a photograph of a small wooden boat", ""]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    tok = make_tokenizer(root / "tokenizer")
    model = make_text_encoder(root / "text_encoder")
    return QwenVLTextEncoder(model, tok, torch.device("cpu"), torch.float32)


def _images(n: int, h: int = 40, w: int = 56, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)  # (B, 3, H, W)


@pytest.mark.slow
def test_scores_are_probabilities_deterministic_and_batch_independent(encoder):
    vqa = scorer("vqa", ScorerInputs(text_encoder=encoder))
    images = _images(3)
    batch = vqa.score(images, PROMPTS)
    assert all(0.0 < s <= 1.0 for s in batch), batch
    assert vqa.score(images, PROMPTS) == batch  # same image, same score
    for i in range(3):
        alone = vqa.score(images[i : i + 1], PROMPTS[i : i + 1])[0]
        assert alone == pytest.approx(batch[i], rel=1e-6, abs=1e-9)
    # the image and the prompt both matter
    assert len(set(vqa.score(images[:1].expand(3, -1, -1, -1), PROMPTS))) == 3
    assert len(set(vqa.score(images, [PROMPTS[0]] * 3))) == 3


def test_the_score_is_p_yes_over_the_full_vocabulary_at_the_answer_position(encoder):
    vqa = VQAScore.from_text_encoder(encoder)
    image = _images(1)[0]
    patches, grid = vision_input(image, vqa.layout)
    ids = vqa.input_ids(PROMPTS[0], patches.shape[0] // vqa.layout.merge_size**2)
    input_ids = torch.tensor([ids])
    with torch.no_grad():  # every position's logits, as a plain forward gives them
        kwargs = dict(input_ids=input_ids, pixel_values=patches, image_grid_thw=grid[None])
        if vqa._pass_token_types:
            kwargs["mm_token_type_ids"] = (input_ids == vqa.image_token).int()
        logits = encoder.model(**kwargs).logits[0].float()  # (T, V)
    k = len(vqa.answer)
    probs = logits[-k:].softmax(-1)  # (k, V): each position predicts the next answer token
    expected = torch.prod(torch.stack([probs[j, t] for j, t in enumerate(vqa.answer)]))
    assert vqa.score(image[None], PROMPTS[:1])[0] == pytest.approx(float(expected), rel=1e-5)
    assert ids.count(vqa.image_token) == patches.shape[0]  # merge 1 in the tiny tower


def test_prompt_encoding_is_the_same_after_scoring_with_its_model(encoder):
    before, mask = encoder.encode(PROMPTS[:2])
    scorer("vqa", ScorerInputs(text_encoder=encoder)).score(_images(1), PROMPTS[:1])
    after, mask_after = encoder.encode(PROMPTS[:2])
    assert torch.equal(mask, mask_after) and torch.equal(before, after)


def test_a_model_without_a_qwen_vl_encoder_is_refused_naming_the_setting():
    from ditfleet.model.tiny.text_encoder import TinyTextEncoder

    with pytest.raises(ValueError, match=r"quality.scorers: 'vqa'.*TinyTextEncoder.*model.path"):
        VQAScore.from_text_encoder(TinyTextEncoder.__new__(TinyTextEncoder))
    with pytest.raises(ValueError, match=r"quality.scorers: 'vqa'.*none loaded"):
        scorer("vqa")


def _transformers_processor(layout: VisionLayout):
    from transformers import Qwen2VLImageProcessor

    kwargs = dict(
        patch_size=layout.patch_size,
        temporal_patch_size=layout.temporal_patch_size,
        merge_size=layout.merge_size,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    # the area bounds are min_pixels/max_pixels in 4.x, size={shortest_edge, longest_edge} in 5.x
    return Qwen2VLImageProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, **kwargs)


@pytest.mark.parametrize(
    "h, w, max_err, mean_err",
    [
        (56, 84, 1e-5, 1e-6),  # already multiples of 28: no resize, the same numbers
        # resized: torch's antialiased bicubic vs PIL's; on random noise (the worst case for two
        # kernels' differences) a quarter level apart on average (1 level = 0.015 here)
        (100, 60, 0.3, 0.006),
    ],
)
def test_the_preprocessing_matches_transformers_qwen2_vl_processor(h, w, max_err, mean_err):
    layout = VisionLayout()  # the published tower: patch 14, merge 2, two frames
    image = _images(1, h, w, seed=3)[0]
    patches, grid = vision_input(image, layout)
    ref = _transformers_processor(layout)(images=[image], return_tensors="pt")
    assert grid.tolist() == ref["image_grid_thw"][0].tolist()
    assert patches.shape == ref["pixel_values"].shape
    diff = (patches - ref["pixel_values"].float()).abs()
    assert float(diff.max()) < max_err and float(diff.mean()) < mean_err, (
        float(diff.max()),
        float(diff.mean()),
    )
