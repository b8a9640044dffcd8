"""The step cache (model.step_cache): per image, per CFG branch, exact when off or too short,
the same under every modulation-cache mode, and no recompiles when the compiled DiT skips."""

from __future__ import annotations

import pytest
import torch

from ditfleet.compile import CompileConfig, apply_compile, count_compiles, warm_up
from ditfleet.model import load_pipeline
from ditfleet.model.step_cache import StepCache
from ditfleet.model.step_cache_config import (
    PRESETS,
    StepCacheConfig,
    StepCacheError,
    check_schedule,
    parse_step_cache,
)
from tests.support.compile_helpers import SMALL_BUCKETS, random_embeds

STEPS = 8
# Short enough for CPU tests: one warm-up step, the last step exact, a threshold the random
# model's residuals fall under often enough to reuse and exceed sometimes.
SHORT = StepCacheConfig(
    threshold=0.36, compute_blocks=1, warmup_steps=1, max_consecutive_skips=2, exact_last_steps=1, min_steps=4
)
SEEDS = [11, 12, 13, 14]


def _inputs(pipe, batch: int, start: int = 0) -> dict:
    """Per-image prompts that do not depend on the batch: image k always gets seed-k embeddings."""
    rows = [random_embeds(pipe, 1, 5, seed=100 + k) for k in range(start, start + batch)]
    neg, neg_mask = random_embeds(pipe, 1, 3, seed=7)
    return dict(
        prompt_embeds=torch.cat([e for e, _ in rows]),
        prompt_embeds_mask=torch.cat([m for _, m in rows]),
        negative_prompt_embeds=neg.expand(batch, -1, -1),
        negative_prompt_embeds_mask=neg_mask.expand(batch, -1),
    )


def _generate(pipe, inputs, seeds, hook=None, steps=STEPS, cfg=4.0):
    return pipe.generate(
        **inputs, height=32, width=48, steps=steps, true_cfg_scale=cfg, seeds=list(seeds), step_hook=hook
    )


def _hook(pipe, config=SHORT) -> StepCache:
    return StepCache(config, pipe.transformer.config.num_layers)


@pytest.fixture(scope="module")
def serial(random_model_dir):
    return load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)


def test_it_reuses_work_and_counts_every_block(serial):
    hook = _hook(serial)
    _generate(serial, _inputs(serial, 2), SEEDS[:2], hook)
    layers = serial.transformer.config.num_layers
    for counts in hook.per_image():
        assert counts["blocks_computed"] + counts["blocks_reused"] == STEPS * 2 * layers  # 2 CFG branches
        assert counts["blocks_reused"] > 0
    assert hook.describe() == SHORT.describe()


def test_first_warmup_and_last_steps_compute_and_runs_are_capped(serial):
    hook = _hook(serial)
    _generate(serial, _inputs(serial, 4), SEEDS, hook)
    for branch in (0, 1):
        for image in range(4):
            reused = hook.reused_steps(branch, image)
            assert 0 not in reused and STEPS - 1 not in reused  # warm-up 1, exact last 1
            # Never more than max_consecutive_skips (2) reused steps in a row.
            assert max(_runs(reused), default=0) <= SHORT.max_consecutive_skips


def _runs(steps: list[int]) -> list[int]:
    runs, last, n = [], None, 0
    for s in steps:
        n = n + 1 if last is not None and s == last + 1 else 1
        last = s
        runs.append(n)
    return runs


def test_an_image_decides_the_same_alone_and_in_a_batch_of_4(serial):
    batch_hook = _hook(serial)
    together = _generate(serial, _inputs(serial, 4), SEEDS, batch_hook)
    some_reuse = False
    for k in range(4):
        alone_hook = _hook(serial)
        alone = _generate(serial, _inputs(serial, 1, start=k), SEEDS[k : k + 1], alone_hook)
        for branch in (0, 1):
            assert alone_hook.reused_steps(branch, 0) == batch_hook.reused_steps(branch, k), (k, branch)
            some_reuse |= bool(alone_hook.reused_steps(branch, 0))
        # Batched kernels round differently for other batch sizes; the decisions did not move.
        torch.testing.assert_close(alone[0], together[k], atol=1e-4, rtol=0)
    assert some_reuse
    # The batch-mates differ in what they reuse, so the test tells per-image from per-batch.
    assert len({tuple(batch_hook.reused_steps(0, k)) for k in range(4)}) > 1


def test_each_cfg_branch_has_its_own_cache_serial_and_batched(random_model_dir, serial):
    batched = load_pipeline(random_model_dir, cfg_mode="batched", load_text_encoder_too=False)
    hooks = {}
    images = {}
    for name, pipe in (("serial", serial), ("batched", batched)):
        hooks[name] = _hook(pipe)
        images[name] = _generate(pipe, _inputs(pipe, 2), SEEDS[:2], hooks[name])
        assert len(hooks[name].branches) == 2
    for branch in (0, 1):
        for image in (0, 1):
            assert hooks["serial"].reused_steps(branch, image) == hooks["batched"].reused_steps(branch, image)
    # Conditional and unconditional branches measure their own residuals.
    cond = hooks["serial"].branches[0].changes[0]
    uncond = hooks["serial"].branches[1].changes[0]
    assert cond != uncond
    torch.testing.assert_close(images["serial"], images["batched"], atol=1e-4, rtol=0)
    # Without CFG: one branch.
    plain = _hook(serial)
    _generate(serial, _inputs(serial, 2), SEEDS[:2], plain, cfg=1.0)
    assert len(plain.branches) == 1


def test_every_modulation_cache_mode_gives_the_same_images(random_model_dir):
    out = {}
    for mode in ("off", "cfg", "table"):
        pipe = load_pipeline(
            random_model_dir, cfg_mode="serial", modulation_cache=mode, load_text_encoder_too=False
        )
        hook = _hook(pipe)
        out[mode] = (_generate(pipe, _inputs(pipe, 3), SEEDS[:3], hook), hook.reused_steps(0, 1))
    for mode in ("cfg", "table"):
        assert torch.equal(out[mode][0], out["off"][0]), mode
        assert out[mode][1] == out["off"][1]


def test_too_short_a_schedule_runs_exact_and_says_so(serial):
    exact = _generate(serial, _inputs(serial, 2), SEEDS[:2], steps=3)
    hook = _hook(serial)
    short = _generate(serial, _inputs(serial, 2), SEEDS[:2], hook, steps=3)
    assert torch.equal(short, exact)
    assert hook.describe() == "off (3 steps < min_steps 4)"
    assert all(c["blocks_reused"] == 0 for c in hook.per_image())
    lightning = PRESETS["safe"]
    assert lightning is not None and lightning.inactive_reason(8) == "8 steps < min_steps 20"


def test_off_is_no_hook_and_bit_identical(serial):
    assert parse_step_cache("off") is None and parse_step_cache(None) is None
    a = _generate(serial, _inputs(serial, 2), SEEDS[:2])
    b = _generate(serial, _inputs(serial, 2), SEEDS[:2], hook=None)
    assert torch.equal(a, b)


def test_bad_settings_name_the_key():
    cases = {
        "nope": "sampling.step_cache: unknown preset 'nope'",
        "{'method': 'teacache'}": "sampling.step_cache.method: unknown method 'teacache'",
        "{'threshold': 1.5}": "sampling.step_cache.threshold: must be in (0, 1)",
        "{'threshold': 0}": "sampling.step_cache.threshold: must be in (0, 1)",
        "{'warmup_steps': -1}": "sampling.step_cache.warmup_steps: must be >= 0",
        "{'colour': 1}": "sampling.step_cache: unknown key(s) ['colour']",
        "{'threshold': 'big'}": "sampling.step_cache.threshold: expected a number",
    }
    for text, message in cases.items():
        value = text if not text.startswith("{") else eval(text)
        with pytest.raises(StepCacheError) as err:
            parse_step_cache(value)
        assert message in str(err.value), (text, str(err.value))
    with pytest.raises(StepCacheError, match=r"sampling.step_cache: the schedule is too short.*8 steps"):
        check_schedule(PRESETS["safe"], 8)
    check_schedule(PRESETS["safe"], 50)
    assert parse_step_cache({"preset": "fast", "threshold": 0.1}).compute_blocks == 1


def test_presets_are_published_values():
    safe, fast = PRESETS["safe"], PRESETS["fast"]
    assert (safe.compute_blocks, safe.warmup_steps, safe.threshold) == (
        8,
        8,
        0.12,
    )  # cache-dit's Qwen-Image example
    assert (fast.compute_blocks, fast.threshold) == (1, 0.24)
    # Fn on a model with few blocks: a quarter of them, at least one; Qwen-Image's 60 as published.
    assert (
        safe.compute_blocks_for(60) == 8
        and safe.compute_blocks_for(4) == 1
        and fast.compute_blocks_for(60) == 1
    )


def test_compiled_dit_skips_without_recompiling(random_model_dir):
    bucket = SMALL_BUCKETS[0]
    pipe = load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)
    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    warm_up(pipe, (bucket,), batch_sizes=(4,))
    eager = load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)
    kw = dict(height=bucket.height, width=bucket.width, steps=STEPS, true_cfg_scale=4.0, seeds=SEEDS)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        hook = _hook(pipe)
        compiled = pipe.generate(**_inputs(pipe, 4), **kw, step_hook=hook)
    assert tally.count == 0
    reference_hook = _hook(eager)
    reference = eager.generate(**_inputs(eager, 4), **kw, step_hook=reference_hook)
    # Subsets of the batch of every size ran through the compiled blocks.
    assert any(hook.reused_steps(0, k) for k in range(4))
    for k in range(4):
        assert hook.reused_steps(0, k) == reference_hook.reused_steps(0, k)
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=0)
