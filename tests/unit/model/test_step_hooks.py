"""The sampler's per-step hook point (model.step_hooks): called around every step, and the
default (and any hook that hands the transformer back) leaves the images bit-identical."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.step_hooks import NO_STEP_HOOK, NoStepHook, Step, StepHook
from tests.support.compile_helpers import random_embeds

KW = dict(height=32, width=48, steps=3, true_cfg_scale=4.0, seeds=[1, 2])


class Recording(NoStepHook):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, steps: int, batch: int) -> None:
        self.calls.append(("start", steps, batch))

    def forward(self, step: Step, transformer):
        def counted(*args):
            self.calls.append(("forward", step.index, float(step.sigma) > float(step.sigma_next)))
            return transformer(*args)

        return counted


def _inputs(pipe):
    cond, mask = random_embeds(pipe, 2, 6, seed=0)
    neg, _ = random_embeds(pipe, 1, 2, seed=1)
    return dict(prompt_embeds=cond, prompt_embeds_mask=mask, negative_prompt_embeds=neg.expand(2, -1, -1))


def test_the_default_is_a_step_hook():
    assert isinstance(NO_STEP_HOOK, StepHook)


@pytest.mark.parametrize("cfg_mode", ["serial", "batched"])
def test_a_hook_sees_every_step_and_changes_nothing(random_model_dir, cfg_mode):
    pipe = load_pipeline(random_model_dir, cfg_mode=cfg_mode, load_text_encoder_too=False)
    plain = pipe.generate(**_inputs(pipe), **KW)
    hook = Recording()
    hooked = pipe.generate(**_inputs(pipe), **KW, step_hook=hook)
    assert torch.equal(plain, hooked)
    passes = 2 if cfg_mode == "serial" else 1  # two CFG forwards per step, or one of 2B
    expected = [("start", 3, 2)]
    for i in range(3):
        expected += [("forward", i, True)] * passes
    assert hook.calls == expected
