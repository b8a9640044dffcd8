"""The step cache (model.generation.step_cache): per image, per CFG branch, exact when off or too short,
the same under every modulation-cache mode, and no recompiles when the compiled DiT skips; each
property for both methods (DBCache, TeaCache) and with TaylorSeer's forecast."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ditfleet.compile import CompileConfig, WarmupRuns, apply_compile, count_compiles, warm_up
from ditfleet.model import load_pipeline
from ditfleet.model.generation.pipeline import Sampling
from ditfleet.model.generation.step_cache import StepCache
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


def _generate(pipe, inputs, seeds, config=SHORT, steps=STEPS, cfg=4.0, height=32, width=48):
    """(images, the step cache that served them: None when `config` is None)."""
    out = pipe.with_step_cache(config).run(inputs, Sampling(height, width, steps, list(seeds), cfg))
    return out.images, out.step_cache


@pytest.fixture(scope="module")
def serial(random_model_dir):
    return load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)


def _teacache(pipe, taylorseer_order: int, height: int = 32, width: int = 48) -> StepCacheConfig:
    """TeaCache with a threshold that splits the 4 test images at their first candidate step.

    Its signal (the first block's modulated input) sees only the noisy latents and the timestep,
    which are statistically alike for every seed, so any fixed threshold would treat the 4
    images alike; the threshold is put in the widest gap between their first rescaled changes
    instead, so that some reuse where others compute."""
    probe = dataclasses.replace(SHORT_TEACACHE, threshold=0.99)
    _, hook = _generate(pipe, _inputs(pipe, 4), SEEDS, probe, height=height, width=width)
    first = sorted(hook.branches[0].changes[k][0][1] for k in range(4))
    gap, low = max((b - a, a) for a, b in zip(first, first[1:]))
    return dataclasses.replace(SHORT_TEACACHE, threshold=low + gap / 2, taylorseer_order=taylorseer_order)


SHORT_TEACACHE = StepCacheConfig(
    method="teacache", threshold=0.5, warmup_steps=1, max_consecutive_skips=2, exact_last_steps=1, min_steps=4
)


@pytest.fixture(scope="module", params=["dbcache", "dbcache+taylorseer", "teacache", "teacache+taylorseer"])
def config(request, serial) -> StepCacheConfig:
    """Each method, with and without TaylorSeer, at settings that reuse on the random model."""
    method, _, taylor = request.param.partition("+")
    if method == "dbcache":
        return dataclasses.replace(SHORT, taylorseer_order=1 if taylor else 0)
    return _teacache(serial, 1 if taylor else 0)


@pytest.mark.slow
def test_it_reuses_work_and_counts_every_block(serial, config):
    _, hook = _generate(serial, _inputs(serial, 4), SEEDS, config)
    layers = serial.transformer.config.num_layers
    fn = config.compute_blocks_for(layers)  # teacache: 0, a reused step runs no block at all
    for k, counts in enumerate(hook.per_image()):
        assert counts["blocks_computed"] + counts["blocks_reused"] == STEPS * 2 * layers  # 2 CFG branches
        reused = sum(len(hook.reused_steps(b, k)) for b in (0, 1))
        assert counts["blocks_reused"] == reused * (layers - fn)
    assert sum(c["blocks_reused"] for c in hook.per_image()) > 0
    assert hook.describe() == config.describe()


@pytest.mark.slow
def test_first_warmup_and_last_steps_compute_and_runs_are_capped(serial, config):
    _, hook = _generate(serial, _inputs(serial, 4), SEEDS, config)
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


@pytest.mark.slow
def test_an_image_decides_the_same_alone_and_in_a_batch_of_4(serial, config):
    together, batch_hook = _generate(serial, _inputs(serial, 4), SEEDS, config)
    some_reuse = False
    for k in range(4):
        alone, alone_hook = _generate(serial, _inputs(serial, 1, start=k), SEEDS[k : k + 1], config)
        for branch in (0, 1):
            assert alone_hook.reused_steps(branch, 0) == batch_hook.reused_steps(branch, k), (k, branch)
            some_reuse |= bool(alone_hook.reused_steps(branch, 0))
        # Batched kernels round differently for other batch sizes; the decisions did not move.
        torch.testing.assert_close(alone[0], together[k], atol=1e-4, rtol=0)
    assert some_reuse
    # The batch-mates differ in what they reuse, so the test tells per-image from per-batch.
    assert len({tuple(batch_hook.reused_steps(0, k)) for k in range(4)}) > 1


@pytest.mark.slow
def test_each_cfg_branch_has_its_own_cache_serial_and_batched(random_model_dir, serial, config):
    batched = load_pipeline(random_model_dir, cfg_mode="batched", load_text_encoder_too=False)
    hooks = {}
    images = {}
    for name, pipe in (("serial", serial), ("batched", batched)):
        images[name], hooks[name] = _generate(pipe, _inputs(pipe, 2), SEEDS[:2], config)
        assert len(hooks[name].branches) == 2
    for branch in (0, 1):
        for image in (0, 1):
            assert hooks["serial"].reused_steps(branch, image) == hooks["batched"].reused_steps(branch, image)
    # Conditional and unconditional branches keep their own residuals (TeaCache's signal sees
    # no text, so its two branches may decide alike; what they reuse differs).
    cond, uncond = (hooks["serial"].branches[b].tensors["d0"] for b in (0, 1))
    assert not torch.allclose(cond, uncond)
    torch.testing.assert_close(images["serial"], images["batched"], atol=1e-4, rtol=0)
    # Without CFG: one branch.
    _, plain = _generate(serial, _inputs(serial, 2), SEEDS[:2], config, cfg=1.0)
    assert len(plain.branches) == 1


@pytest.mark.slow
def test_every_modulation_cache_mode_gives_the_same_images(random_model_dir, config):
    out = {}
    for mode in ("off", "cfg", "table"):
        pipe = load_pipeline(
            random_model_dir, cfg_mode="serial", modulation_cache=mode, load_text_encoder_too=False
        )
        images, hook = _generate(pipe, _inputs(pipe, 3), SEEDS[:3], config)
        out[mode] = (images, hook.reused_steps(0, 1))
    for mode in ("cfg", "table"):
        assert torch.equal(out[mode][0], out["off"][0]), mode
        assert out[mode][1] == out["off"][1]


@pytest.mark.slow
def test_too_short_a_schedule_runs_exact_and_says_so(serial):
    exact, _ = _generate(serial, _inputs(serial, 2), SEEDS[:2], None, steps=3)
    short, hook = _generate(serial, _inputs(serial, 2), SEEDS[:2], steps=3)
    assert torch.equal(short, exact)
    assert hook.describe() == "off (3 steps < min_steps 4)"
    assert all(c["blocks_reused"] == 0 for c in hook.per_image())
    lightning = PRESETS["safe"]
    assert lightning is not None and lightning.inactive_reason(8) == "8 steps < min_steps 20"


@pytest.mark.slow
def test_off_builds_no_cache_and_is_the_public_call(serial):
    assert parse_step_cache("off") is None and parse_step_cache(None) is None
    assert parse_step_cache(False) is None  # YAML's bare `off`
    a, cache = _generate(serial, _inputs(serial, 2), SEEDS[:2], None)
    assert cache is None
    b = serial.generate(
        **_inputs(serial, 2), height=32, width=48, steps=STEPS, true_cfg_scale=4.0, seeds=SEEDS[:2]
    )
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="StepCacheConfig"):  # parsed once, in the spec: typed below
        load_pipeline("tiny", step_cache="safe")


def test_bad_settings_name_the_key():
    cases = {
        "nope": "sampling.step_cache: unknown preset 'nope'",
        "{'method': 'fbcache'}": "sampling.step_cache.method: unknown method 'fbcache'",
        "{'threshold': 1.5}": "sampling.step_cache.threshold: must be in (0, 1)",
        "{'threshold': 0}": "sampling.step_cache.threshold: must be in (0, 1)",
        "{'warmup_steps': -1}": "sampling.step_cache.warmup_steps: must be >= 0",
        "{'colour': 1}": "sampling.step_cache: unknown key(s) ['colour']",
        "{'threshold': 'big'}": "sampling.step_cache.threshold: expected a number",
        "{'taylorseer_order': 3}": "sampling.step_cache.taylorseer_order: must be 0 (off) to 2",
        "{'method': 'teacache', 'coefficients': [1, 2]}": "sampling.step_cache.coefficients: expected 5 numbers",
        "{'method': 'teacache', 'coefficients': 'x'}": "sampling.step_cache.coefficients: expected a list",
        "{'method': 'teacache', 'compute_blocks': 4}": "sampling.step_cache.compute_blocks: only method 'dbcache'",
        "{'coefficients': [1, 2, 3, 4, 5]}": "sampling.step_cache.coefficients: only method 'teacache'",
    }
    for text, message in cases.items():
        value = text if not text.startswith("{") else eval(text)
        with pytest.raises(StepCacheError) as err:
            parse_step_cache(value)
        assert message in str(err.value), (text, str(err.value))
    with pytest.raises(StepCacheError, match=r"sampling.step_cache: the schedule is too short.*8 steps"):
        check_schedule(PRESETS["safe"], 8)
    check_schedule(PRESETS["safe"], 50)
    assert parse_step_cache({"preset": "safe", "threshold": 0.1}).compute_blocks == 8
    tea = parse_step_cache({"method": "teacache", "coefficients": [0, 0, 0, 1, 0]})
    assert tea.coefficients == (0.0, 0.0, 0.0, 1.0, 0.0) and tea.compute_blocks_for(60) == 0
    # What a manifest records: the settings that act, not the other method's field.
    assert "compute_blocks" not in tea.describe() and "coefficients" not in PRESETS["safe"].describe()
    assert parse_step_cache(tea.to_dict()) == tea  # the fingerprint's form reads back as it was


def test_presets_are_published_values():
    safe, fast = PRESETS["safe"], PRESETS["fast"]
    # cache-dit's Qwen-Image DBCache example.
    assert (safe.method, safe.compute_blocks, safe.warmup_steps, safe.threshold) == ("dbcache", 8, 8, 0.12)
    # TeaCache at vLLM-Omni's Qwen-Image coefficients and its "~2x" threshold, TaylorSeer order 1.
    assert (fast.method, fast.threshold, fast.taylorseer_order) == ("teacache", 0.6, 1)
    assert fast.coefficients == (-450.0, 280.0, -45.0, 3.2, -0.02)
    # Fn on a model with few blocks: a quarter of them, at least one; Qwen-Image's 60 as published.
    assert safe.compute_blocks_for(60) == 8 and safe.compute_blocks_for(4) == 1
    assert fast.compute_blocks_for(60) == 0


def _forecast(taylorseer_order: int, residual, computed: tuple[int, ...], at: int) -> torch.Tensor:
    """The residual a reused row gets at step `at` after computing `residual(t)` at `computed`."""
    cache = StepCache(dataclasses.replace(SHORT, taylorseer_order=taylorseer_order), num_layers=4)
    cache.start(20, 1)
    for t in computed:
        cache.call(t, (0,))._remember([0], residual(t))  # type: ignore[union-attr]
    return cache.call(at, (0,))._forecast([0])  # type: ignore[union-attr]


def test_taylorseer_extrapolates_the_residual_over_the_steps_since():
    torch.manual_seed(0)
    a, b, c = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    steps = (2, 4, 7)  # computed, unevenly spaced; reused at 10

    def linear(t):
        return a + b * t

    def quadratic(t):
        return a + b * t + c * t * t

    # Off: the last computed residual as kept. Order 1: a residual linear in the step is exact.
    assert torch.equal(_forecast(0, linear, steps, 10), linear(7))
    torch.testing.assert_close(_forecast(1, linear, steps, 10), linear(10))
    # A curved residual: each order forecasts it better than the one below (backward differences
    # are approximate, so not exactly).
    errors = [(_forecast(k, quadratic, steps, 10) - quadratic(10)).abs().max() for k in (0, 1, 2)]
    assert errors[2] < errors[1] < errors[0], errors
    # A row that computed once has no derivative yet: its residual is repeated.
    assert torch.equal(_forecast(2, quadratic, (7,), 10), quadratic(7))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dbcache", "teacache"])
def test_compiled_dit_skips_without_recompiling(random_model_dir, serial, method):
    bucket = SMALL_BUCKETS[0]
    pipe = load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)
    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    warm_up(pipe, (bucket,), WarmupRuns(batch_sizes=(4,)))
    eager = load_pipeline(random_model_dir, cfg_mode="serial", load_text_encoder_too=False)
    size = dict(height=bucket.height, width=bucket.width)
    config = SHORT if method == "dbcache" else _teacache(serial, taylorseer_order=1, **size)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        compiled, hook = _generate(pipe, _inputs(pipe, 4), SEEDS, config, **size)
    assert tally.count == 0
    reference, reference_hook = _generate(eager, _inputs(eager, 4), SEEDS, config, **size)
    # Subsets of the batch ran through the compiled blocks: the images did not all decide alike.
    assert any(hook.reused_steps(0, k) for k in range(4))
    assert len({tuple(hook.reused_steps(0, k)) for k in range(4)}) > 1
    for k in range(4):
        assert hook.reused_steps(0, k) == reference_hook.reused_steps(0, k)
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_teacache_normalises_block_0s_input_once_per_pass(serial, monkeypatch):
    """TeaCache's signal is block 0's modulated input; the rows that compute run block 0 on it
    (`run_blocks(start=...)`) instead of normalising and modulating the image stream again."""
    import ditfleet.model.qwen_image.transformer as transformer

    real, image_norms = transformer._norm_modulate, []
    tokens = (32 // 16) * (48 // 16)

    def counted(x, shift, scale, eps):
        if x.shape[1] == tokens:
            image_norms.append(x.shape[0])
        return real(x, shift, scale, eps)

    monkeypatch.setattr(transformer, "_norm_modulate", counted)
    always_compute = dataclasses.replace(SHORT_TEACACHE, threshold=1e-9)
    _, cache = _generate(serial, _inputs(serial, 2), SEEDS[:2], always_compute)
    assert cache is not None and cache.inactive is None
    assert sum(c["blocks_reused"] for c in cache.per_image()) == 0
    layers, passes = serial.transformer.config.num_layers, STEPS * 2  # serial CFG: two a step
    # Each block normalises the image stream twice (before attention, before the MLP), the output
    # norm once more; no more (recomputing TeaCache's signal would add one a pass).
    assert image_norms == [2] * (passes * (2 * layers + 1))
