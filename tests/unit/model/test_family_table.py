"""model/family.py's one table: a checkpoint's model_index.json `_class_name` picks its family,
what the loader accepts is that table, and the family states its own forward cost."""

from __future__ import annotations

import json
import shutil

import pytest

from ditfleet.model.family import (
    FAMILIES,
    check_model_index,
    family_of_class,
    load_pipeline,
    model_family,
    resolve_model_dir,
)
from ditfleet.model.loading.folder import TINY_MODEL_DIR, WeightsError
from ditfleet.model.qwen_image.family import QWEN_IMAGE, TINY, forward_flops
from ditfleet.model.qwen_image.published import PUBLISHED, published_config
from ditfleet.model.qwen_image.transformer_config import TransformerConfig


def test_each_published_checkpoint_class_has_its_family():
    for model in ("qwen-image", "qwen-image-2512"):
        assert check_model_index(PUBLISHED / model) is QWEN_IMAGE
    assert FAMILIES["QwenImagePipeline"] is QWEN_IMAGE


def test_the_tiny_path_is_still_the_tiny_configuration():
    assert model_family("tiny") is TINY
    assert model_family(TINY_MODEL_DIR) is QWEN_IMAGE  # its folder is a Qwen-Image checkpoint


def _folder_of_class(tmp_path, class_name):
    root = tmp_path / "m"
    shutil.copytree(TINY_MODEL_DIR, root)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return root


def test_an_unknown_class_is_refused_naming_the_file_and_the_class(tmp_path):
    root = _folder_of_class(tmp_path, "FluxPipeline")
    for ask in (resolve_model_dir, model_family, load_pipeline, check_model_index):
        with pytest.raises(
            WeightsError, match=r"m/model_index.json: _class_name is 'FluxPipeline'.*QwenImagePipeline"
        ):
            ask(root)


def test_the_lookup_is_one_function_over_the_table():
    assert family_of_class("QwenImagePipeline", "x") is QWEN_IMAGE
    with pytest.raises(WeightsError, match="where.json: _class_name is None"):
        family_of_class(None, "where.json")


def test_a_folder_without_model_index_is_the_default_family(tmp_path):
    root = _folder_of_class(tmp_path, "QwenImagePipeline")
    (root / "model_index.json").unlink()
    assert model_family(root) is QWEN_IMAGE
    assert load_pipeline(root, "cpu").transformer.config.num_layers > 0  # arguments pass through


def test_the_family_states_its_forward_flops():
    """Qwen-Image at 1328x1328 with 64 text tokens, by hand from the published config: 60 blocks of
    linears over both streams, attention over all tokens, the modulation; plus the embeddings."""
    raw = published_config("qwen-image", "transformer/config.json")
    D, T, n = 3072, 83 * 83 + 64, 60
    by_hand = n * (2 * T * 12 * D * D + 4 * T * T * D + 24 * D * D) + 2 * (83 * 83 * 64 * D + 64 * 3584 * D)
    assert QWEN_IMAGE.forward_flops(raw, 1328, 1328, 64) == by_hand
    # about 130 TFLOP per forward at batch 1: the figure every "% of peak" divides by
    assert 1.2e14 < by_hand < 1.4e14
    split = forward_flops(TransformerConfig.from_dict(raw), 83 * 83, 64, batch=2)
    assert split["total"] == 2 * by_hand and split["modulation"] == 2 * n * 24 * D * D
