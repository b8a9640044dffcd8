"""Broken checkpoint folders are refused with an error that names the file, before any device work.

Each case loads with device="cuda" on purpose: on a machine without a GPU, touching the device
would raise a different error, so getting the WeightsError proves the check ran first.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ditfleet.model import load_pipeline
from ditfleet.model.loading.weights import WeightsError
from ditfleet.model.qwen_image.published import published_config
from ditfleet.workers.selftest.parts import write_sharded

INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded_dir(random_model_dir, tmp_path_factory):
    """The tiny random model with its transformer re-saved as hub-style shards + index."""
    root = tmp_path_factory.mktemp("sharded") / "m"
    shutil.copytree(random_model_dir, root)
    tdir = root / "transformer"
    state = {}
    for f in tdir.glob("*.safetensors"):
        state.update(load_file(str(f)))
        f.unlink()
    files = write_sharded(iter(sorted(state.items())), tdir, shard_bytes=40_000)
    assert len(files) >= 3
    return root


def _copy(sharded_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(sharded_dir, dst)
    return dst, sorted((dst / "transformer").glob("*-of-*.safetensors"))


def test_sharded_folder_loads(sharded_dir, random_model_dir):
    a = load_pipeline(sharded_dir).transformer.state_dict()
    b = load_pipeline(random_model_dir).transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_named(sharded_dir, tmp_path):
    root, shards = _copy(sharded_dir, tmp_path)
    shards[1].unlink()
    with pytest.raises(WeightsError, match=rf"{INDEX}.*{shards[1].name}"):
        load_pipeline(root, device="cuda")


def test_missing_shard_without_index_named(sharded_dir, tmp_path):
    root, shards = _copy(sharded_dir, tmp_path)
    (root / "transformer" / INDEX).unlink()
    shards[-1].unlink()
    with pytest.raises(WeightsError, match=rf"{shards[-1].name}.*missing"):
        load_pipeline(root, device="cuda")


def test_truncated_shard_named(sharded_dir, tmp_path):
    root, shards = _copy(sharded_dir, tmp_path)
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightsError, match=rf"{shards[0]}: truncated.*Re-download"):
        load_pipeline(root, device="cuda")


def test_truncated_header_named(sharded_dir, tmp_path):
    root, shards = _copy(sharded_dir, tmp_path)
    shards[2].write_bytes(shards[2].read_bytes()[:100])
    with pytest.raises(WeightsError, match=rf"{shards[2]}: truncated"):
        load_pipeline(root, device="cuda")


@pytest.mark.parametrize("wrong", ["absent-file", "another-download"])
def test_index_naming_the_wrong_file(sharded_dir, tmp_path, wrong):
    """The index sends one tensor to a file the folder lacks, or to a shard that does not hold it."""
    root, shards = _copy(sharded_dir, tmp_path)
    index_path = root / "transformer" / INDEX
    index = json.loads(index_path.read_text())
    key = next(k for k, v in index["weight_map"].items() if v == shards[0].name)
    if wrong == "absent-file":
        index["weight_map"][key] = "diffusion_pytorch_model-00009-of-00009.safetensors"
        message = rf"{INDEX}.*diffusion_pytorch_model-00009-of-00009.safetensors"
    else:
        index["weight_map"][key] = shards[1].name
        message = rf"{INDEX}.*not where the index says.*{key}"
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=message):
        load_pipeline(root, device="cuda")


def test_transformer_config_of_another_architecture(sharded_dir, tmp_path):
    root, _ = _copy(sharded_dir, tmp_path)
    flux = {"_class_name": "FluxTransformer2DModel", "num_layers": 19, "num_single_layers": 38}
    (root / "transformer" / "config.json").write_text(json.dumps(flux))
    with pytest.raises(ValueError, match=r"transformer/config.json.*FluxTransformer2DModel"):
        load_pipeline(root, device="cuda")


def test_published_config_over_tiny_weights(sharded_dir, tmp_path):
    """A real config with weights of another size: the keys and shapes are named, nothing read."""
    root, _ = _copy(sharded_dir, tmp_path)
    config = {**published_config("qwen-image", "transformer/config.json"), "num_layers": 2}
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        WeightsError,
        match=r"transformer: shape mismatch for \d+ keys.*\(48, 256\) vs model \(3072, 256\).*config.json",
    ):
        load_pipeline(root, device="cuda")


def test_pipeline_of_another_kind(sharded_dir, tmp_path):
    root, _ = _copy(sharded_dir, tmp_path)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(WeightsError, match=r"m/model_index.json.*FluxPipeline"):
        load_pipeline(root, device="cuda")


@pytest.mark.parametrize("component", ["vae", "text_encoder"])
def test_truncated_component_named(sharded_dir, tmp_path, component):
    root, _ = _copy(sharded_dir, tmp_path)
    weights = next((root / component).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(WeightsError, match=rf"{weights}: truncated"):
        load_pipeline(root, device="cuda")


def test_text_encoder_of_another_architecture(sharded_dir, tmp_path):
    root, _ = _copy(sharded_dir, tmp_path)
    t5 = {"architectures": ["T5EncoderModel"], "d_model": 4096}
    (root / "text_encoder" / "config.json").write_text(json.dumps(t5))
    with pytest.raises(WeightsError, match=r"text_encoder/config.json.*T5EncoderModel"):
        load_pipeline(root, device="cuda")
