"""Text encoder placement (gpu | cpu | offload) and the per-actor embedding cache, on the bundled
tiny model: the same images whichever placement, each prompt encoded once."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.workers.actor import place_text_encoder
from ditfleet.workers.contract import ModelPlacement, WorkerConfig
from ditfleet.workers.generate import image_requests, shard_prompts
from ditfleet.workers.rows import PromptRow
from ditfleet.workers.text_embeddings import EmbeddingCache, PlacedTextEncoder

PROMPTS = [
    "a small red circle at the top left on a blue background",
    "a large green square at the centre on a yellow background",
    "a small red circle at the top left on a blue background",  # repeated
]


def _generate(pipe) -> torch.Tensor:
    inputs = pipe.encode_guidance(PROMPTS, " ", 4.0, 64)
    return pipe.generate(**inputs, height=128, width=128, steps=2, true_cfg_scale=4.0, seeds=[1, 2, 3])


def _placed(placement: str, **kwargs) -> tuple:
    pipe = load_pipeline("tiny", load_text_encoder_too=placement == "gpu")
    placed = place_text_encoder(
        pipe, "tiny", WorkerConfig(output_uri="unused", placement=ModelPlacement(text_encoder=placement))
    )
    if kwargs:
        placed = PlacedTextEncoder(placed.encoder, placement, "cpu", 2**20, pipe.transformer, **kwargs)
        pipe.text_encoder = placed
    return pipe, placed


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return _generate(load_pipeline("tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["gpu", "cpu", "offload"])
def test_images_are_identical_whichever_placement(placement, reference):
    pipe, placed = _placed(placement)
    placed.prefetch([*PROMPTS, " "], 64)  # what a worker does at the start of a shard
    images = _generate(pipe)
    placed.release()
    assert torch.equal(images, reference)
    assert torch.equal(_generate(pipe), reference)  # after release: from the cache, or encoded again


@pytest.mark.slow
def test_offload_swapping_the_dit_out_and_back_changes_nothing(reference):
    pipe, placed = _placed("offload", swap_dit=True)
    assert placed.prefetch([*PROMPTS, " "], 64) == 3  # unique texts: two prompts and the negative
    assert placed.dit_swaps == 1
    assert torch.equal(_generate(pipe), reference)
    assert placed.encoder_calls == 3  # generation found every text prefetched


@pytest.mark.slow
def test_a_repeated_prompt_and_the_negative_are_encoded_once(reference):
    pipe, placed = _placed("gpu")
    calls: list[list[str]] = []
    encode = placed.encoder.encode

    def counting(prompts, max_length=512):
        calls.append(list(prompts))
        return encode(prompts, max_length)

    placed.encoder.encode = counting  # the real encoder, observed
    for _ in range(3):
        assert torch.equal(_generate(pipe), reference)
    texts = [p for c in calls for p in c]
    assert sorted(texts) == sorted(set(PROMPTS) | {" "})  # each distinct text exactly once
    stats = placed.stats()
    assert stats["encoder_calls"] == 3 and stats["hits"] > 0


def test_offload_outside_prefetch_does_not_keep_what_it_encodes():
    pipe, placed = _placed("offload")
    pipe.encode_prompt(["warm-up prompt"], 64)
    assert len(placed.cache) == 0  # warm-up's encodings never reach a request
    placed.prefetch(["warm-up prompt"], 64)
    assert len(placed.cache) == 1


def test_cache_is_bounded_by_bytes_least_recently_used_first():
    cache = EmbeddingCache(max_bytes=3 * 40)  # three 10-float rows
    rows = {k: torch.full((10,), float(i)) for i, k in enumerate("abcd")}
    for k in "abc":
        cache.put((k, 8), rows[k])
    assert cache.get(("a", 8)) is not None  # a is now the most recent
    cache.put(("d", 8), rows["d"])
    assert cache.get(("b", 8)) is None  # b was the least recently used
    assert cache.bytes == 120 and cache.evictions == 1
    cache.put(("huge", 8), torch.zeros(100))  # over the whole budget: not kept
    assert cache.get(("huge", 8)) is None and len(cache) == 3
    with pytest.raises(ValueError, match=">= 0"):
        EmbeddingCache(-1)


def test_shard_prompts_cover_prompts_and_negatives_where_cfg_is_on():
    def row(i: int, neg: str | None, cfg: float) -> PromptRow:
        return PromptRow(
            id=str(i), prompt=f"p{i}", negative_prompt=neg, seed=i, width=128, height=128,
            requested_width=None, requested_height=None, bucket="128x128", steps=2, true_cfg_scale=cfg,
            num_images=1, file="prompts.parquet", row=i, extra={},
        )  # fmt: skip

    texts = shard_prompts(image_requests([row(0, " ", 4.0), row(1, "blurry", 4.0), row(2, "x", 1.0)]))
    assert texts == ["p0", "p1", "p2", " ", "blurry"]


def test_a_bad_placement_is_refused():
    with pytest.raises(ValueError, match="gpu, cpu or offload|one of"):
        ModelPlacement(text_encoder="disk")


@pytest.mark.slow
def test_worker_with_offloaded_encoder_writes_the_same_images_encoding_each_text_once(tmp_path):
    """A whole shard through the worker (tiny model, repeated prompts): the same image bytes as
    with the encoder on the device, and each distinct text encoded once."""
    import dataclasses

    from ditfleet.workers.actor import GenerationWorker
    from ditfleet.workers.output.manifest import read_manifests
    from ditfleet.workers.storage import open_store
    from tests.support.worker_fixtures import shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 8, sizes=False, extra=False)  # 4 colours x 3 shapes
    digests = {}
    for placement in ("gpu", "offload"):
        out = str(tmp_path / placement)
        config = dataclasses.replace(
            worker_config("tiny", out, batch_size=4), placement=ModelPlacement(text_encoder=placement)
        )
        worker = GenerationWorker(config)
        assert worker.run_shard(shard_of(prompts, 0, 0, 8)).status == "committed"
        stats = worker.text.stats()
        assert stats["placement"] == placement
        if placement == "offload":  # 8 rows, 8 distinct prompts... plus the shared negative " "
            assert stats["encoder_calls"] == 9 and stats["dit_swaps"] == 0
        table = read_manifests(open_store(out)).to_pandas().sort_values("id")
        digests[placement] = list(table["sha256"])
    assert digests["gpu"] == digests["offload"]


def test_offloaded_qwen_encoder_gives_each_prompt_its_own_encoding(tmp_path):
    """A small random Qwen2.5-VL through the real QwenVLTextEncoder: offload moves it (`.to`), a
    batch's embeddings are each prompt's own, token counts come from its tokenizer."""
    pytest.importorskip("transformers")
    from ditfleet.model.qwen_image.text_encoder import QwenVLTextEncoder
    from tests.support.qwen_text_encoder import make_text_encoder, make_tokenizer

    make_tokenizer(tmp_path / "tokenizer")
    make_text_encoder(tmp_path / "text_encoder")
    raw = QwenVLTextEncoder.from_dirs(tmp_path / "text_encoder", tmp_path / "tokenizer", "cpu", torch.float32)
    placed = PlacedTextEncoder(raw, "offload", "cpu", 2**20)
    texts = ["a red fox", "a lighthouse on the far rocks at dusk, thin mist over the water"]
    assert placed.prefetch([*texts, texts[0]], 64) == 2
    embeds, mask = placed.encode(texts, 64)
    for i, text in enumerate(texts):
        alone, alone_mask = raw.encode([text], 64)
        n = int(alone_mask.sum())
        assert int(mask[i].sum()) == n and torch.equal(embeds[i, :n], alone[0, :n])
        assert not embeds[i, n:].any()
    assert placed.count_tokens(texts, 64) == [int(m.sum()) for m in mask]
    assert placed.encoder_calls == 2 and raw.device == torch.device("cpu")


@pytest.mark.slow
def test_encoding_ahead_on_another_thread_gives_the_same_images(reference):
    import threading

    pipe, placed = _placed("cpu")
    # The next shard's first batch, encoded on the prefetch thread while nothing else encodes.
    thread = threading.Thread(target=lambda: placed.encode_ahead([*PROMPTS, " "], 64))
    thread.start()
    thread.join()
    assert placed.encoder_calls == 3
    assert torch.equal(_generate(pipe), reference)
    assert placed.encoder_calls == 3, "generation found every text encoded ahead"
    # offload's encoder waits on the host: it is not brought onto the device beside the DiT.
    _, offloaded = _placed("offload")
    assert offloaded.encode_ahead(PROMPTS, 64) == 0 and offloaded.encoder_calls == 0
