"""The modulation table built once per bucket (model.qwen_image.transformer.fill_modulation_table,
TextToImagePipeline.prefill_modulation) and the 'auto' mode that makes it a GPU's default:
per-step values bit for bit, no modulation computed by any request after the warm-up, with CFG
or without, and images identical to the uncached path."""

from __future__ import annotations

import pytest
import torch

from ditfleet.jobs.spec import JobSpec
from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.modulation_cache import ModulationCache
from ditfleet.model.settings import PipelineSettings, resolve_modulation_cache
from tests.unit.model.test_modulation_cache import ModCallCounter

STEPS = 3


def _generate(pipe, cfg: bool, seeds=(3, 4)):
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(len(seeds), 6, 16, generator=g)
    neg = torch.randn(len(seeds), 2, 16, generator=g)
    return pipe.generate(
        prompt_embeds=pos,
        negative_prompt_embeds=neg if cfg else None,
        height=32,
        width=48,
        steps=STEPS,
        true_cfg_scale=4.0 if cfg else 1.0,
        seeds=list(seeds),
    )


@pytest.fixture(scope="module")
def pipe(random_model_dir):
    return load_pipeline(random_model_dir)


def test_the_prefilled_table_holds_per_step_modulation_bit_for_bit(pipe):
    pipe.set_modulation_cache("table")
    dit = pipe.transformer
    filled = pipe.prefill_modulation(32, 48, STEPS)
    assert filled == STEPS * len(dit.transformer_blocks)
    entries = list(dit.modulation_cache.table.entries.values())
    assert len(entries) == STEPS
    with torch.no_grad():
        for key, blocks in entries:
            t = key.timestep[0]()
            temb = dit.time_text_embed(t.to(pipe.dtype), pipe.dtype, None)
            for i, block in enumerate(dit.transformer_blocks):
                img_mod, txt_mod = blocks[i]
                assert torch.equal(img_mod, block.img_mod(temb)) and torch.equal(txt_mod, block.txt_mod(temb))


def test_one_batched_gemm_over_the_steps_rounds_differently_within_tolerance(pipe):
    """Why the table is built step by step: one GEMM over every step's temb (M = steps) gives the
    same values only to rounding on this CPU, and the table must equal what a forward computes."""
    pipe.set_modulation_cache("table")
    dit = pipe.transformer
    pipe.prefill_modulation(32, 48, 8)
    key_blocks = [kb for kb in dit.modulation_cache.table.entries.values() if len(kb[1])]
    ts = [kb[0].timestep[0]() for kb in key_blocks]
    with torch.no_grad():
        temb = torch.cat([dit.time_text_embed(t.to(pipe.dtype), pipe.dtype, None) for t in ts])
        for i, block in enumerate(dit.transformer_blocks):
            batched = block.img_mod(temb)
            per_step = torch.cat([kb[1][i][0] for kb in key_blocks])
            torch.testing.assert_close(batched, per_step, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "no_cfg"])
def test_after_the_prefill_no_request_computes_modulation_and_images_are_unchanged(pipe, cfg):
    pipe.set_modulation_cache("off")
    off = _generate(pipe, cfg)
    pipe.set_modulation_cache("table")
    pipe.prefill_modulation(32, 48, STEPS)
    counter = ModCallCounter(pipe.transformer)
    try:
        table = _generate(pipe, cfg)
    finally:
        for h in counter.handles:
            h.remove()
    assert counter.total() == 0  # the first request too
    assert torch.equal(off, table)


def test_prefill_fills_nothing_where_the_mode_is_not_table(pipe):
    pipe.set_modulation_cache("cfg")
    assert pipe.prefill_modulation(32, 48, STEPS) == 0
    pipe.set_modulation_cache("auto")  # on the CPU: cfg
    assert pipe.prefill_modulation(32, 48, STEPS) == 0
    assert pipe.transformer.modulation_cache.nbytes() == 0


def test_auto_is_table_on_a_gpu_and_cfg_on_the_cpu():
    assert PipelineSettings().modulation_cache == "auto"
    assert resolve_modulation_cache("auto", "cuda") == "table"
    assert resolve_modulation_cache("auto", "cpu") == "cfg"
    assert resolve_modulation_cache("off", "cuda") == "off"
    cache = ModulationCache(2, "auto")
    assert cache.mode_on("cuda") == "table" and cache.mode_on("cpu") == "cfg"
    base = {"input": {"path": "/in.parquet"}, "output": {"uri": "/out"}}
    gpu = JobSpec.model_validate({**base, "workers": {"gpus": 1}, "sampling": {"steps": 8}})
    assert gpu.memory_request().table_steps == (8,)  # the memory plan counts the table
    cpu = JobSpec.model_validate({**base, "model": {"device": "cpu"}})
    assert cpu.memory_request().table_steps == ()
