"""`ditfleet plan --selftest`'s cost estimate for an edit job (jobs/plan_cost.py): the self-test
measures text-to-image steps, so each bucket's step is scaled by the family's FLOPs of a forward
with the row's sources over one without; a text job's estimate is what it was."""

from __future__ import annotations

import json

import pytest

from ditfleet.jobs.plan_cost import cost_plan_line, estimate_cost
from ditfleet.jobs.spec.file import parse_spec
from ditfleet.model.family import model_family
from tests.support.paths import REPO

LINES = [  # a self-test's speed lines, as speed.py shapes them (numbers made up)
    {"stage": "env", "status": "pass", "device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3"},
    {"stage": "cfg_step", "status": "measured", "size": "1024x1024", "text_len": 64,
     "ms_per_cfg_step": {"off": 260.0, "cfg": 250.0, "table": 245.0}},
    {"stage": "vae_decode", "status": "measured", "size": "1024x1024", "eager_ms": 90.0, "compiled_ms": 60.0},
]  # fmt: skip
TINY_DIT = json.loads((REPO / "model" / "tiny" / "weights" / "transformer" / "config.json").read_text())


@pytest.fixture
def spec():
    text = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()
    text = text.replace("jobs/examples/prompts.parquet", str(REPO / "jobs" / "examples" / "prompts.parquet"))
    text = text.replace("[128x128, 160x96, 96x160]", "[128x128]")
    return parse_spec(text)


def _estimate(spec, sources=(), config=TINY_DIT):
    kwargs = dict(compiled_dit=False, compiled_vae=False, sources=sources, transformer_config=config)
    return estimate_cost(spec, LINES, "selftest.jsonl", **kwargs)


def test_an_edit_jobs_step_costs_its_sources_flops(spec):
    text, edit = _estimate(spec), _estimate(spec, sources=[(128, 128)])
    family = model_family("tiny")
    factor = family.forward_flops(TINY_DIT, 128, 128, 64, [(128, 128)]) / family.forward_flops(
        TINY_DIT, 128, 128, 64
    )
    assert factor > 1.0
    step = 250.0 * (128 * 128) / (1024 * 1024)  # the 'cfg' step scaled to the bucket by area
    decode = 90.0 * (128 * 128) / (1024 * 1024)
    steps = spec.sampling.steps
    assert text["by_bucket"]["128x128"]["seconds_per_image"] == round((steps * step + decode) / 1000, 4)
    assert edit["by_bucket"]["128x128"]["seconds_per_image"] == round(
        (steps * step * factor + decode) / 1000, 4
    )
    assert edit["by_bucket"]["128x128"]["edit_step_factor"] == factor
    assert "edit_step_factor" not in text["by_bucket"]["128x128"] and text["sources"] == []
    line = cost_plan_line(edit)
    assert "CFG on, 1 source a row" in line and f"(step x{factor:.2f} for the sources)" in line


def test_without_the_models_config_the_sources_are_said_not_counted(spec):
    edit = _estimate(spec, sources=[(128, 128), (64, 64)], config=None)
    assert edit["by_bucket"]["128x128"]["edit_step_factor"] is None
    assert (
        edit["by_bucket"]["128x128"]["seconds_per_image"]
        == _estimate(spec)["by_bucket"]["128x128"]["seconds_per_image"]
    )
    assert "2 sources a row" in cost_plan_line(edit) and "sources not counted" in cost_plan_line(edit)
