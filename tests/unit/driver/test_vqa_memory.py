"""The memory plan of the vqa scorer (model.qwen_image.memory_activations.vqa_activation_bytes): its forward
against the CPU allocator's measured peak on a Qwen2.5-VL of the published widths (one decoder
layer, one vision block, the vocabulary cut), the number it adds at Qwen-Image's size, the
"score" phase only where the text encoder sits on the GPU, and `ditfleet plan` saying it."""

from __future__ import annotations

import json

import pytest
import torch

from ditfleet.jobs.cli import main
from ditfleet.model.memory import Runtime, plan_memory
from ditfleet.model.qwen_image.memory_activations import VQA_TEMPLATE_TOKENS, vqa_activation_bytes
from ditfleet.model.qwen_image.memory_model import QwenImageMemory
from tests.support.memory_measure import peak_allocated_bytes
from tests.unit.driver.test_memory_plan import (
    DTYPES,
    TOLERANCE,
    _job,
    published_configs,
    qwen_configs_dir,  # noqa: F401 - a fixture
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SIZE = 224  # 256 patches, 64 image tokens: a multiple of 28, so no resize
# fp32 takes about 20 s on 2 cores (a 3584-wide decoder layer built and run twice): slow;
# bf16 (where the CPU has bf16 units, as test_memory_plan measures it) about 11 s.
MEASURED = [pytest.param(torch.float32, marks=pytest.mark.slow), DTYPES[1]]


def _real_width_qwen_vl(dtype: torch.dtype):
    """The published text encoder's widths (hidden 3584, MLP 18944; vision 1280, MLP 3420, 16
    heads, patch 14, merge 2) with one layer of each, the vision block full attention, and a
    512-token vocabulary (the tiny tokenizer's ids; the logits term is one position's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    published = published_configs()[2]
    text = {k: v for k, v in published["text_config"].items() if k != "layer_types"}
    text = {k: v for k, v in text.items() if not k.endswith("_token_id")}  # ids of the full vocabulary
    text.update(num_hidden_layers=1, max_window_layers=1, vocab_size=512, bos_token_id=0, eos_token_id=2)
    vision = {**published["vision_config"], "depth": 1, "fullatt_block_indexes": [0]}
    ids = dict(image_token_id=508, video_token_id=509, vision_start_token_id=510, vision_end_token_id=511)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    model = model.to_empty(device="cpu").to(dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    return model, json.loads(config.to_json_string())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", MEASURED)
def test_the_vqa_estimate_matches_the_measured_peak_at_the_published_widths(dtype, tmp_path):
    from ditfleet.model.quality.vqa import VQAScore
    from tests.support.qwen_text_encoder import make_tokenizer

    model, config = _real_width_qwen_vl(dtype)
    vqa = VQAScore(model, make_tokenizer(tmp_path / "tokenizer"))
    image = torch.randint(
        0, 256, (1, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    prompt = "a small red circle at the top left on a white background"
    vqa.score(image, [prompt])  # first call: lazy tables and kernels, outside the measurement
    measured = peak_allocated_bytes(lambda: vqa.score(image, [prompt]))
    # The estimate's question at this tokenizer's length: image tokens + prompt + the template.
    image_tokens = (SIZE // 14) ** 2 // 4
    prompt_tokens = len(vqa.input_ids(prompt, image_tokens)) - image_tokens - VQA_TEMPLATE_TOKENS
    estimate = vqa_activation_bytes(config, SIZE, SIZE, prompt_tokens, 2 if dtype == torch.bfloat16 else 4)
    assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate)


def test_vqa_adds_a_score_phase_where_the_text_encoder_sits_on_the_gpu():
    qwen = QwenImageMemory.from_configs(*published_configs(), name="Qwen-Image")
    text_encoder = published_configs()[2]
    # At 1328x1328 in bf16: 8,836 patches (1316 / 14 = 94 a side), 2,209 image tokens, the
    # prompt at 512 and the question's 48: the language model's peak (2,769 tokens) sets it.
    assert vqa_activation_bytes(text_encoder, 1328, 1328, 512, 2) == 516_298_304
    plan = lambda te, size, vqa: plan_memory(  # noqa: E731
        qwen, height=size, width=size, batch=1, run=Runtime(text_encoder=te, text_len=512, vqa=vqa)
    )
    on_gpu, without = plan("gpu", 1328, True), plan("gpu", 1328, False)
    assert on_gpu.activations["score"] == 516_298_304 and "score" not in without.phases
    assert {k: v for k, v in on_gpu.phases.items() if k != "score"} == without.phases
    assert on_gpu.peak_phase == "decode"  # at 1328 the decode holds more...
    assert plan("gpu", 256, True).peak_phase == "score"  # ...at 256 the score is the peak
    for te in ("cpu", "offload"):  # the score runs on the host, beside the encoder
        assert plan(te, 1328, True).phases == plan(te, 1328, False).phases


def test_ditfleet_plan_says_where_vqa_runs_and_what_it_holds(tmp_path, qwen_configs_dir, capsys):  # noqa: F811
    for te, said in (
        (
            "gpu",
            "vqa: one text-encoder forward per image after the decode, 0.52 GB of activations at 1328x1328",
        ),
        ("offload", "vqa: runs where the text encoder is (model.text_encoder: offload), on the host"),
    ):
        job = _job(tmp_path, qwen_configs_dir, batch_size=1, gpu_memory_gb=80, text_encoder=te)
        job.write_text(job.read_text() + "quality: {scorers: [vqa]}\n")
        assert main(["plan", str(job)]) == 0
        assert said in capsys.readouterr().out
        assert main(["plan", str(job), "--json"]) == 0
        first = json.loads(capsys.readouterr().out)["memory"]["buckets"][0]
        assert ("score" in first["phases_gb"]) == (te == "gpu")
