"""sampling.cfg_mode: serial and batched CFG give the same images, the modulation cache works in
both, and "auto" picks by device and pass size."""

from __future__ import annotations

import pytest

from ditfleet.model import load_pipeline
from ditfleet.model.generation.pipeline import cfg_batched_for
from tests.support.compile_helpers import random_embeds

KW = dict(height=32, width=48, steps=2, true_cfg_scale=4.0, seeds=[1, 2])


def _inputs(pipe):
    cond, mask = random_embeds(pipe, 2, 6, seed=0)
    mask[1, 4:] = 0  # padded conditional branch
    neg, _ = random_embeds(pipe, 1, 2, seed=1)  # a shorter shared negative
    return dict(prompt_embeds=cond, prompt_embeds_mask=mask, negative_prompt_embeds=neg.expand(2, -1, -1))


def _modulation_calls(pipe, runs: int = 1) -> list[int]:
    """img_mod calls per generate() call, over `runs` calls."""
    calls: list[int] = []
    hooks = [
        b.img_mod[1].register_forward_hook(lambda *_: calls.append(1))
        for b in pipe.transformer.transformer_blocks
    ]
    counts = []
    try:
        for _ in range(runs):
            before = len(calls)
            pipe.generate(**_inputs(pipe), **KW)
            counts.append(len(calls) - before)
    finally:
        for h in hooks:
            h.remove()
    return counts


@pytest.mark.slow
def test_serial_and_batched_cfg_give_the_same_images(random_model_dir):
    serial = load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)
    batched = load_pipeline(random_model_dir, cfg_mode="batched", load_text_encoder_too=False)
    a = serial.generate(**_inputs(serial), **KW)
    b = batched.generate(**_inputs(batched), **KW)
    assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "batched"])
def test_modulation_cache_is_effective_in_both_modes(random_model_dir, mode):
    pipe = load_pipeline(random_model_dir, cfg_mode=mode, load_text_encoder_too=False)
    blocks, steps = len(pipe.transformer.transformer_blocks), KW["steps"]
    pipe.set_modulation_cache("off")
    off = _modulation_calls(pipe)[0]
    pipe.set_modulation_cache("cfg")
    cfg = _modulation_calls(pipe)[0]
    pipe.set_modulation_cache("table")
    table = _modulation_calls(pipe, runs=2)
    # Serial without the cache computes it in both passes; every other way, once per step, and
    # the table computes it only for the first request of a schedule.
    assert off == (2 if mode == "serial" else 1) * steps * blocks
    assert cfg == steps * blocks
    assert table == [steps * blocks, 0]


def test_auto_batches_small_passes_on_cuda_only():
    assert cfg_batched_for("auto", "cpu", 1, 64, 12, 1) is False
    assert cfg_batched_for("auto", "cuda", 3, 1024, 60, 58) is True  # 3 x 1084 tokens, 0.1% pad
    assert cfg_batched_for("auto", "cuda", 1, 6889, 60, 1) is False  # 1328x1328: one pass fills it
    assert cfg_batched_for("auto", "cuda", 2, 64, 60, 1) is False  # batching would pad 24%
    assert cfg_batched_for("serial", "cuda", 1, 64, 1, 1) is False
    assert cfg_batched_for("batched", "cpu", 8, 6889, 300, 1) is True
    with pytest.raises(ValueError, match="cfg_mode"):
        cfg_batched_for("parallel", "cpu", 1, 1, 1, 1)


def test_spec_cfg_mode_reaches_the_worker(tmp_path):
    from ditfleet.jobs.spec import JobSpec

    base = {"input": {"path": str(tmp_path / "p.parquet")}, "output": {"uri": str(tmp_path / "o")}}
    spec = JobSpec.model_validate({**base, "sampling": {"cfg_mode": "batched"}})
    assert spec.to_worker_config().pipeline.cfg_mode == "batched"
    assert spec.image_settings()["cfg_mode"] == "batched"
    assert JobSpec.model_validate(base).sampling.cfg_mode == "auto"
    with pytest.raises(ValueError, match="cfg_mode"):
        JobSpec.model_validate({**base, "sampling": {"cfg_mode": "parallel"}})
    # compile.dit takes "auto" too; the worker decides it (CUDA, enough images per bucket).
    assert (
        JobSpec.model_validate({**base, "compile": {"dit": "auto"}}).to_worker_config().compile.dit == "auto"
    )
    with pytest.raises(ValueError, match="dit"):
        JobSpec.model_validate({**base, "compile": {"dit": "sometimes"}})
