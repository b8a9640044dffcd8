"""The compiled DiT: one graph pair per resolution bucket, then no compile for any prompt length
(1-1024 tokens) or batch size up to batch_size, padded or not; and a fresh actor that loads the
graphs and kernels from the shared compile cache instead of compiling them.

Dynamo's "eager" backend guards and recompiles exactly as Inductor does, at no codegen cost; one
slow case runs Inductor itself on one bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ditfleet.compile import CompileConfig, WarmupRuns, apply_compile, count_compiles, warm_up
from ditfleet.compile.config import AUTO_DIT_IMAGES_PER_BUCKET
from ditfleet.compile.policy import resolve_auto
from ditfleet.model import load_pipeline
from tests.support.compile_helpers import SMALL_BUCKETS, generate, random_embeds
from tests.support.paths import REPO

BATCH_SIZE = 3
LENGTHS = (1, 2, 7, 64, 300, 1024)


def _inputs(pipe, batch: int, length: int, seed: int, padded: bool) -> dict:
    embeds, mask = random_embeds(pipe, batch, length, seed)
    if padded and batch > 1 and length > 1:
        mask[0, length // 2 :] = 0  # one shorter prompt: the split attention path
    neg, neg_mask = random_embeds(pipe, 1, 1, seed + 1)
    return {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": neg.expand(batch, -1, -1),
        "negative_prompt_embeds_mask": neg_mask.expand(batch, -1),
    }


@pytest.mark.slow
def test_dit_warms_once_per_bucket_and_never_recompiles(random_model_dir):
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False)
    report = apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    assert len(report.methods) == 2 * len(pipe.transformer.transformer_blocks)
    warm = warm_up(pipe, SMALL_BUCKETS, WarmupRuns(batch_sizes=(BATCH_SIZE,)))
    # Two functions per bucket (attention_inputs, attention_outputs), shared by every block.
    assert warm.compiles == 2 * len(SMALL_BUCKETS)
    assert set(report.status.values()) == {"compiled"} and report.fallbacks == {}

    eager = load_pipeline(random_model_dir, load_text_encoder_too=False)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for bucket in SMALL_BUCKETS:
            for batch in range(1, BATCH_SIZE + 1):
                for i, length in enumerate(LENGTHS):
                    inputs = _inputs(pipe, batch, length, seed=i, padded=i % 2 == 0)
                    image = generate(pipe, bucket, inputs, seeds=range(batch), steps=1)
                    assert image.shape == (batch, 3, bucket.height, bucket.width)
                    if batch == 2 and length in (2, 300):  # compiled and eager agree
                        expected = generate(eager, bucket, inputs, seeds=range(batch), steps=1)
                        torch.testing.assert_close(image, expected, atol=1e-4, rtol=0)
    assert tally.count == 0

    # The guard is real: a resolution the warm-up never saw compiles.
    with count_compiles() as fresh:
        generate(pipe, SMALL_BUCKETS[0].__class__(64, 32), _inputs(pipe, 1, 5, 0, False), steps=1)
    assert fresh.count == 2


@pytest.mark.slow
def test_modulation_cache_outside_the_compiled_regions(random_model_dir):
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False)
    apply_compile(pipe, CompileConfig(vae=False, dit=True, dit_backend="eager"))
    calls = []
    hooks = [
        b.img_mod[1].register_forward_hook(lambda *_: calls.append(1))
        for b in pipe.transformer.transformer_blocks
    ]
    try:
        generate(pipe, SMALL_BUCKETS[0], _inputs(pipe, 2, 5, 0, True), seeds=(1, 2))
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == 2 * len(pipe.transformer.transformer_blocks)  # 2 steps, once per step


def test_dit_auto_turns_on_for_cuda_jobs_that_repay_the_warm_up():
    auto = CompileConfig(dit="auto")
    enough = AUTO_DIT_IMAGES_PER_BUCKET * 2
    assert resolve_auto(auto, "cuda", enough, buckets=2).dit is True
    assert resolve_auto(auto, "cuda", enough - 1, buckets=2).dit is False
    assert resolve_auto(auto, "cpu", 10**6, buckets=1).dit is False
    assert resolve_auto(CompileConfig(dit=True), "cpu", 1, buckets=1).dit is True
    with pytest.raises(ValueError, match="auto"):
        CompileConfig(dit="sometimes")


def test_dit_mode_by_device_and_fp8_gemms():
    """Autotuned matmuls for a bf16 DiT on CUDA; cuBLAS (Inductor's default) for an FP8 DiT, whose
    scaled-GEMM search costs minutes a bucket for a loss (compile.config, default_dit_mode);
    "default" on CPU; a mode the job sets is kept."""
    auto = CompileConfig(dit=True)
    assert resolve_auto(auto, "cuda", None, 1).dit_mode == "max-autotune-no-cudagraphs"
    assert resolve_auto(auto, "cuda", None, 1, scaled_gemms=True).dit_mode == "default"
    assert resolve_auto(auto, "cpu", None, 1, scaled_gemms=True).dit_mode == "default"
    chosen = CompileConfig(dit=True, dit_mode="max-autotune")
    assert resolve_auto(chosen, "cuda", None, 1, scaled_gemms=True).dit_mode == "max-autotune"
    resolved = resolve_auto(auto, "cuda", None, 1, scaled_gemms=True)
    assert resolved.describe("cuda")["dit"] == "inductor:default"  # what the cache key and stats record


@pytest.mark.parametrize(("mode", "scaled"), [("fp8", True), ("fp8-weight-only", False)])
def test_runs_scaled_gemms_reads_the_quantized_dit(random_model_dir, mode, scaled):
    from ditfleet.model.qwen_image.fp8 import quantize_model, runs_scaled_gemms

    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False)
    assert runs_scaled_gemms(pipe.transformer) is False
    assert runs_scaled_gemms(quantize_model(pipe.transformer, mode)) is scaled


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quantization", "atol"),
    [
        ("none", 1e-4),
        # Inductor itself (not only Dynamo's guards) takes the FP8 GEMMs: torch._scaled_mm and the
        # per-token quantization, or the dequantize-then-GEMM of weight-only. It fuses the
        # activation scaling, which may round an fp8 code differently from eager.
        pytest.param("fp8", 2e-2, marks=pytest.mark.slow),
        pytest.param("fp8-weight-only", 2e-2, marks=pytest.mark.slow),
    ],
)
def test_inductor_dit_one_bucket_any_length_and_batch(random_model_dir, quantization, atol):
    pipe = load_pipeline(random_model_dir, load_text_encoder_too=False, quantization=quantization)
    apply_compile(pipe, CompileConfig(vae=False, dit=True))
    warm = warm_up(pipe, SMALL_BUCKETS[:1], WarmupRuns(batch_sizes=(2,)))
    assert warm.compiles == 2
    eager = load_pipeline(random_model_dir, load_text_encoder_too=False, quantization=quantization)
    with torch._dynamo.config.patch(error_on_recompile=True), count_compiles() as tally:
        for batch, length in ((1, 1), (3, 300)):
            inputs = _inputs(pipe, batch, length, seed=batch, padded=True)
            image = generate(pipe, SMALL_BUCKETS[0], inputs, seeds=range(batch), steps=1)
            expected = generate(eager, SMALL_BUCKETS[0], inputs, seeds=range(batch), steps=1)
            torch.testing.assert_close(image, expected, atol=atol, rtol=0)
    assert tally.count == 0


@pytest.mark.slow
def test_a_fresh_actor_loads_the_compiled_dit_from_the_shared_cache(random_model_dir, tmp_path):
    """Actor A compiles the DiT with Inductor and publishes; actor B, a fresh process with an
    empty local Inductor cache, loads the blob: its warm-up finds both graphs in the cache and
    builds no kernel library, its images equal A's bit for bit, and no request compiles."""
    cases = [[1, 1], [3, 7], [2, 300]]  # batch sizes and prompt lengths the warm-up never ran
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "DITFLEET_COMPILE_CACHE_KEY": "dit cache test key, 32 bytes...",
    }
    root = REPO
    results = {}
    for actor in ("a", "b"):
        args = {
            "model": str(random_model_dir),
            "buckets": [SMALL_BUCKETS[0].name],
            "store": str(tmp_path / "shared"),
            "cfg_mode": "serial",
            "cases": cases,
            "images": str(tmp_path / f"{actor}.pt"),
        }
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.dit_cache_child", json.dumps(args)],
            cwd=root,
            env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{actor}")},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        results[actor] = json.loads(done.stdout.strip().splitlines()[-1])
    a, b = results["a"], results["b"]
    assert (a["load"], a["save"], b["load"], b["save"]) == ("missing", "saved", "loaded", "skipped")
    assert a["key"] == b["key"] and a["fxgraph_miss"] == 2 and a["startup_kernel_builds"] > 0
    assert b["kernels_loaded"] == a["save_kernels"] > 0
    # B: both graphs (attention_inputs, attention_outputs) from the cache, no kernel built.
    assert (b["fxgraph_hit"], b["fxgraph_miss"], b["fxgraph_bypass"]) == (2, 0, 0), b
    assert b["startup_kernel_builds"] == 0, b
    assert set(b["status"].values()) == {"compiled"}
    for r in (a, b):
        assert (r["request_compiles"], r["request_kernel_builds"]) == (0, 0), r
    images_a, images_b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert sorted(images_a) == sorted(images_b) and len(images_a) == len(cases)
    for name, image in images_a.items():
        assert torch.equal(image, images_b[name]), name
    print(f"\nstart-up of the compiled DiT: {a['startup_s']}s compiling, {b['startup_s']}s from the cache")
