"""The DiT reads a batch's text padding from the device once per mask, not once per forward: a
padded batch's steps and CFG passes reuse the facts (model.qwen_image.attention.padding_facts).

On the CPU the proxy for a host sync is a device-to-host read made by model/qwen_image/attention.py
(`.tolist()`, `.item()`, `bool()` of a tensor), counted as tests/unit/workers/test_batch_syncs.py
counts the batch generator's.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import ditfleet.model.qwen_image.attention as attention
from ditfleet.model.qwen_image.attention import padding_facts
from ditfleet.model.qwen_image.loader import load_pipeline

ATTENTION_FILE = str(Path(attention.__file__).resolve())


def _count_reads(monkeypatch) -> dict[str, int]:
    counts = {"n": 0}
    for name in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, **kwargs):
            caller = inspect.stack(context=0)[1].filename
            if str(Path(caller).resolve()) == ATTENTION_FILE:
                counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("cfg_batched", [False, True])
def test_one_read_per_mask_however_many_steps(monkeypatch, cfg_batched):
    pipe = load_pipeline("tiny")
    pipe.cfg_mode = "batched" if cfg_batched else "serial"
    dim = pipe.transformer.config.joint_attention_dim
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 6, dim, generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 3:] = 0  # a padded batch: the split attention path
    neg = torch.randn(2, 2, dim, generator=g)
    kwargs = dict(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=None,
        height=32,
        width=32,
        true_cfg_scale=4.0,
        seeds=[0, 1],
    )
    reference = {steps: pipe.generate(**kwargs, steps=steps) for steps in (1, 4)}
    counts = _count_reads(monkeypatch)
    reads = {}
    for steps in (1, 4):
        counts["n"] = 0
        # a fresh mask tensor: nothing read for it yet
        got = pipe.generate(**{**kwargs, "prompt_embeds_mask": mask.clone()}, steps=steps)
        reads[steps] = counts["n"]
        assert torch.equal(got, reference[steps])  # same images
    # one read per padded mask of the batch (the conditional one; joined with the negative's
    # when CFG is batched), the same for 1 step as for 4 (8 forwards)
    assert reads[1] == reads[4] == 1, reads


def test_the_facts_follow_the_mask_not_its_address():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert padding_facts(mask) == (True, (2, 3))
    mask[0, 2] = 1  # changed in place: read again
    assert padding_facts(mask) == (True, (3, 3))
    assert padding_facts(torch.tensor([[1, 0, 1]])) == (False, (2,))  # not a prefix
