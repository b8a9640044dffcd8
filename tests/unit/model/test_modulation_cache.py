"""Modulation caching across serial CFG: fewer modulation calls, bit-identical images, safe keys."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.testing.models import TINY_TRANSFORMER, load_transformer


class ModCallCounter:
    """Forward hooks on every block's img_mod.1 / txt_mod.1 (they are called as modules)."""

    def __init__(self, transformer):
        self.calls: dict[str, int] = {}
        self.handles = []
        for i, block in enumerate(transformer.transformer_blocks):
            for name in ("img_mod", "txt_mod"):
                key = f"{i}.{name}"
                self.calls[key] = 0
                self.handles.append(getattr(block, name)[1].register_forward_hook(self._hook(key)))

    def _hook(self, key):
        def hook(*_):
            self.calls[key] += 1

        return hook

    def reset(self):
        self.calls = dict.fromkeys(self.calls, 0)

    def per_block(self) -> set[int]:
        return set(self.calls.values())

    def total(self) -> int:
        return sum(self.calls.values())


def _generate(pipe, seeds=(3, 4), steps=3):
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(len(seeds), 6, 16, generator=g)
    neg = torch.randn(len(seeds), 2, 16, generator=g)
    return pipe.generate(
        prompt_embeds=pos,
        negative_prompt_embeds=neg,
        height=32,
        width=48,
        steps=steps,
        true_cfg_scale=4.0,
        seeds=list(seeds),
    )


@pytest.fixture(scope="module")
def pipe(random_model_dir):
    return load_pipeline(random_model_dir)


def test_cfg_mode_computes_modulation_once_per_step_and_keeps_images(pipe):
    counter = ModCallCounter(pipe.transformer)
    pipe.set_modulation_cache("off")
    off = _generate(pipe, steps=3)
    assert counter.per_block() == {6}  # 3 steps x 2 CFG passes
    counter.reset()
    pipe.set_modulation_cache("cfg")
    cfg = _generate(pipe, steps=3)
    assert counter.per_block() == {3}  # one per step
    assert torch.equal(off, cfg)


def test_table_mode_computes_nothing_after_first_request(pipe):
    counter = ModCallCounter(pipe.transformer)
    pipe.set_modulation_cache("off")
    off = _generate(pipe, steps=3)
    pipe.set_modulation_cache("table")
    first = _generate(pipe, steps=3)
    counter.reset()
    second = _generate(pipe, seeds=(3, 4), steps=3)
    assert counter.total() == 0
    assert torch.equal(off, first) and torch.equal(off, second)
    assert pipe.transformer.modulation_cache.nbytes() > 0
    pipe.set_modulation_cache("cfg")
    assert pipe.transformer.modulation_cache.nbytes() == 0


@pytest.fixture()
def transformer(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    QwenImageTransformer2DModel(**{**TINY_TRANSFORMER, "use_additional_t_cond": True}).save_pretrained(
        tmp_path / "t"
    )
    return load_transformer(tmp_path / "t", "cpu", torch.float32)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 16, 64, generator=g), torch.randn(1, 5, 16, generator=g), [[(1, 4, 4)]]


def _two_passes(model, t, t2=None, extra=None, extra2=None, between=None):
    """Two forwards like the two CFG passes of one step; returns modulation calls of block 0."""
    counter = ModCallCounter(model)
    x, txt, shapes = _inputs()
    model(x, txt, None, t, shapes, additional_t_cond=extra)
    if between is not None:
        between()
    out = model(
        x, txt, None, t if t2 is None else t2, shapes, additional_t_cond=extra if extra2 is None else extra2
    )
    for h in counter.handles:
        h.remove()
    return counter.calls["0.img_mod"], out


@torch.no_grad()
def test_same_tensor_hits(transformer):
    calls, _ = _two_passes(transformer, torch.tensor([0.5]), extra=torch.tensor([0]))
    assert calls == 1


@torch.no_grad()
def test_in_place_edit_of_timestep_misses_and_stays_correct(transformer):
    t, extra = torch.tensor([0.5]), torch.tensor([0])
    calls, out = _two_passes(transformer, t, extra=extra, between=lambda: t.mul_(0.5))
    assert calls == 2
    transformer.modulation_cache.set_mode("off")
    x, txt, shapes = _inputs()
    assert torch.equal(out, transformer(x, txt, None, torch.tensor([0.25]), shapes, additional_t_cond=extra))


@torch.no_grad()
def test_a_clone_misses(transformer):
    t = torch.tensor([0.5])
    calls, _ = _two_passes(transformer, t, t2=t.clone(), extra=torch.tensor([0]))
    assert calls == 2


@torch.no_grad()
def test_other_extra_conditioning_misses(transformer):
    calls, _ = _two_passes(
        transformer, torch.tensor([0.5]), extra=torch.tensor([0]), extra2=torch.tensor([1])
    )
    assert calls == 2


def test_grad_enabled_bypasses_cache(transformer):
    calls, _ = _two_passes(transformer, torch.tensor([0.5]), extra=torch.tensor([0]))
    assert calls == 2
    assert all(s.value is None for s in transformer.modulation_cache.slots)


@torch.no_grad()
def test_training_mode_bypasses_cache(transformer):
    transformer.train()
    calls, _ = _two_passes(transformer, torch.tensor([0.5]), extra=torch.tensor([0]))
    assert calls == 2


def test_inference_mode_tensors_hit_and_detect_edits(transformer):
    with torch.inference_mode():
        t, extra = torch.tensor([0.5]), torch.tensor([0])
        assert t.is_inference()
        calls, _ = _two_passes(transformer, t, extra=extra)
        assert calls == 1
        calls, _ = _two_passes(transformer, t, extra=extra, between=lambda: t.mul_(0.5))
        assert calls == 2


@torch.no_grad()
def test_freed_timestep_with_reused_id_never_hits(transformer):
    """The slot holds the timestep weakly: a new tensor at a recycled address is a miss."""
    counter = ModCallCounter(transformer)
    x, txt, shapes = _inputs()
    extra = torch.tensor([0])
    for _ in range(4):  # no CFG: one pass per step, a fresh timestep each step
        transformer(x, txt, None, torch.tensor([0.5]), shapes, additional_t_cond=extra)
    assert counter.calls["0.img_mod"] == 4
