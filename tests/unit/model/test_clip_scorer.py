"""The clip scorer (model.quality.clip_score) on a tiny random CLIPModel saved in the test: scores
in [0, 100], deterministic, batch-independent, equal to the published definition computed by hand;
a model path that holds no CLIP model is refused naming quality.clip_model and the path, both when
loading and when the folder is fetched (workers.scorers)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from ditfleet.model.quality import ScorerInputs, scorer  # noqa: E402
from ditfleet.workers.scorers import build_scorers, fetch_scorer_model  # noqa: E402
from ditfleet.workers.storage import S3Config  # noqa: E402
from ditfleet.workers.weights.fetch import ModelFetchError  # noqa: E402
from tests.support.clip_model import write_clip_model  # noqa: E402

PROMPTS = ["a red cube", "blue", "x y z", "hello world", "0123", "cat", "dog!", "a tree by the sea"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_clip_model(tmp_path_factory.mktemp("clip") / "clip")


def _images(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 40, 48), generator=g, dtype=torch.uint8)  # (B, 3, H, W)


@pytest.mark.slow
def test_scores_are_in_range_deterministic_and_batch_independent(clip_dir):
    clip = scorer("clip", ScorerInputs(models={"clip": clip_dir}))
    images = _images(len(PROMPTS))
    batch = clip.score(images, PROMPTS)
    assert all(0.0 <= s <= 100.0 for s in batch)
    assert any(s > 0 for s in batch) and any(s == 0 for s in batch)  # clipped at 0, not all zero
    assert clip.score(images, PROMPTS) == batch
    for i in (0, 3, 7):
        assert clip.score(images[i : i + 1], PROMPTS[i : i + 1])[0] == pytest.approx(batch[i], abs=1e-5)


@pytest.mark.slow
def test_the_score_is_100_times_the_clipped_cosine(clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    processor = CLIPProcessor.from_pretrained(str(clip_dir))
    clip = scorer("clip", ScorerInputs(models={"clip": clip_dir}))
    images = _images(len(PROMPTS))
    for image, prompt, got in zip(images, PROMPTS, clip.score(images, PROMPTS)):
        inputs = processor(text=[prompt], images=[image], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model(**inputs)  # the full model's own embeddings (projected)
        cos = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)[0]
        assert got == pytest.approx(max(100 * float(cos), 0.0), abs=1e-4)


def test_a_bad_model_path_names_the_setting_and_the_path(tmp_path, clip_dir):
    empty = tmp_path / "not-clip"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"quality\.clip_model: {empty} holds no config\.json"):
        scorer("clip", ScorerInputs(models={"clip": empty}))
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"quality\.clip_model: cannot load .* from {empty}"):
        scorer("clip", ScorerInputs(models={"clip": empty}))
    with pytest.raises(ValueError, match=r"'clip' needs quality\.clip_model"):
        scorer("clip")
    # fetched as a job gives it: the folder's listing is checked before anything loads
    with pytest.raises(ModelFetchError, match=rf"quality\.clip_model: {empty} lacks \*\.safetensors"):
        fetch_scorer_model("clip", str(empty), str(tmp_path / "cache"), S3Config())
    assert fetch_scorer_model("clip", str(clip_dir), str(tmp_path / "cache"), S3Config()) == clip_dir
    [built] = build_scorers(["clip"], models={"clip": str(clip_dir)}, cache_dir=str(tmp_path / "cache"))
    assert built.name == "clip"
