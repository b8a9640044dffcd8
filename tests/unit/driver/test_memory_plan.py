"""The memory plan (model/memory/, driver/memory_plan.py, `ditfleet inspect`): parameter counts
against the modules themselves, activation estimates against the CPU allocator's measured peak
on a real-width slice, and jobs that cannot fit refused naming the largest batch that does."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ditfleet.jobs.cli import main
from ditfleet.model.loading.weights import read_config
from ditfleet.model.memory import (
    GB,
    ModelMemory,
    Runtime,
    checkpoint_size,
    dit_activation_bytes,
    largest_batch,
    plan_memory,
    text_encoder_params,
    transformer_params,
    vae_decode_activation_bytes,
    vae_encode_activation_bytes,
    vae_params,
)
from ditfleet.model.qwen_image.published import PUBLISHED as ALL_PUBLISHED
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.qwen_image.vae import QwenImageVAE, VAEConfig
from tests.support.memory_measure import peak_allocated_bytes
from tests.support.paths import REPO

PUBLISHED = ALL_PUBLISHED / "qwen-image"
# Measured peaks must be within this of the estimate (the estimate follows tensor lifetimes in
# our forward passes; what is left is allocator rounding and small temporaries).
TOLERANCE = 0.10


def published_configs() -> tuple[dict, dict, dict]:
    """transformer, vae, text_encoder config.json of Qwen-Image as published."""
    return tuple(read_config(PUBLISHED / c) for c in ("transformer", "vae", "text_encoder"))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def qwen() -> ModelMemory:
    t, v, te = published_configs()
    return ModelMemory.from_configs(t, v, te, name="Qwen-Image")


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_match_the_modules_built_on_meta(qwen):
    with torch.device("meta"):
        dit = QwenImageTransformer(qwen.transformer)
        vae_dec = QwenImageVAE(qwen.vae, with_encoder=False)
        vae_all = QwenImageVAE(qwen.vae, with_encoder=True)
    assert transformer_params(qwen.transformer) == _count(dit) == 20_430_401_088
    assert vae_params(qwen.vae) == _count(vae_dec)
    assert vae_params(qwen.vae, with_encoder=True) == _count(vae_all)
    # Another shape: odd heads, extra timestep conditioning, no out_channels, encoder attention.
    small = TransformerConfig(
        num_layers=2, attention_head_dim=16, num_attention_heads=3, joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6), use_additional_t_cond=True, out_channels=None,
    )  # fmt: skip
    small_vae = VAEConfig(
        base_dim=32, dim_mult=(1, 2, 4), temperal_downsample=(False, True), attn_scales=(1.0,)
    )
    with torch.device("meta"):
        assert transformer_params(small) == _count(QwenImageTransformer(small))
        assert vae_params(small_vae, with_encoder=True) == _count(QwenImageVAE(small_vae, with_encoder=True))


def test_qwen_text_encoder_count_matches_transformers_on_meta():
    transformers = pytest.importorskip("transformers")  # a test dependency; the reference here
    te = published_configs()[2]
    config = transformers.Qwen2_5_VLConfig(**{k: v for k, v in te.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    assert text_encoder_params(te) == _count(model) == 8_292_166_656


def test_tiny_counts_match_its_checkpoint_headers():
    root = REPO / "model" / "tiny" / "weights"
    params = ModelMemory.from_dir(root).params()
    for component in ("transformer", "text_encoder"):
        assert checkpoint_size(root / component).params == params[component]
    # The VAE checkpoint is the 3D video layout with the encoder; we load 2D decoder slices.
    assert checkpoint_size(root / "vae").params > params["vae"]


def _real_width_slice(dtype: torch.dtype) -> QwenImageTransformer:
    config = TransformerConfig.from_dict({**published_configs()[0], "num_layers": 1})
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    model = model.to_empty(device="cpu").to(dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX. Without them PyTorch's CPU bf16 kernels take fallback paths (the block's
    matmuls took 1.3 s) with scratch allocations of their own, which the estimate, made for the GPU's
    kernels, does not count: on a 2-core Xeon without either the bf16 peak measured 36.7 MB against
    the 28.4 MB estimate while the fp32 one matched, and the VAE decode of a 256x256 image peaked at
    3.1x its estimate and took over ten minutes (its convolutions upcast)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: True)() for name in checks)


# bf16 is measured where the CPU has bf16 units; the GPU self-test measures it on the GPU.
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not _cpu_has_bf16_units(),
            reason="this CPU has no bf16 units: PyTorch's fallback allocates fp32 scratch a GPU does not",
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_dit_estimate_matches_measured_peak_on_a_real_width_block(dtype):
    """1 block of the published width (3072 = 24 x 128, text 3584), the 256x256 bucket."""
    model = _real_width_slice(dtype)
    size, text_len = 256, 64
    h = w = size // 16

    def forward() -> None:
        latents = torch.randn(1, h * w, 64, dtype=dtype)  # made inside: inputs count too
        text = torch.randn(1, text_len, 3584, dtype=dtype)
        mask = torch.ones(1, text_len, dtype=torch.long)
        with torch.no_grad():
            model(latents, text, mask, torch.tensor([0.5], dtype=dtype), [[(1, h, w)]])

    forward()  # first call: lazy tables and kernels, outside the measurement
    measured = peak_allocated_bytes(forward)
    e = 2 if dtype == torch.bfloat16 else 4
    estimate = dit_activation_bytes(model.config, 1, size, size, text_len, e)
    assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("part", ["decode", "encode"])
def test_vae_estimate_matches_measured_peak_at_full_width(dtype, part):
    """The decode of 256 x 256 images, and the encode of an edit model's sources (the plan's
    source_encode phase), at the published widths."""
    config = VAEConfig.from_dict(published_configs()[1])
    with torch.device("meta"):
        vae = QwenImageVAE(config, with_encoder=part == "encode")
    vae = vae.to_empty(device="cpu").to(dtype).eval().requires_grad_(False)
    for p in vae.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(*((1, 16, 32, 32) if part == "decode" else (1, 3, 256, 256)), dtype=dtype)
    run = getattr(vae, part)
    with torch.no_grad():
        run(x)
        measured = peak_allocated_bytes(lambda: run(x))
    formula = vae_decode_activation_bytes if part == "decode" else vae_encode_activation_bytes
    estimate = formula(config, 1, 256, 256, 2 if dtype == torch.bfloat16 else 4)
    assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate)


def test_qwen_image_at_1328_fits_48_gb_only_with_the_text_encoder_off_the_gpu(qwen):
    def plan(te, gb):
        return plan_memory(
            qwen, height=1328, width=1328, batch=1, run=Runtime(text_encoder=te), gpu_memory_gb=gb
        )

    assert plan("gpu", 80).weights["transformer"] == 2 * 20_430_401_088
    assert plan("gpu", 80).fits and plan("cpu", 80).fits and plan("offload", 80).fits
    assert not plan("offload", 80).dit_swapped  # both fit next to each other on 80 GB
    assert not plan("gpu", 48).fits
    assert plan("cpu", 48).fits
    offload = plan("offload", 48)
    assert offload.fits and offload.dit_swapped and offload.host >= offload.weights["transformer"]
    assert not any(plan(te, 24).fits for te in ("gpu", "cpu", "offload"))
    # The VAE decode at full resolution is the activation peak, not the DiT.
    assert plan("cpu", 48).peak_phase == "decode"


def test_largest_batch_is_the_edge_of_fitting(qwen):
    cpu = Runtime(text_encoder="cpu")
    kw = dict(height=1328, width=1328)
    best = largest_batch(qwen, 48, run=cpu, **kw)
    assert best >= 1
    assert plan_memory(qwen, batch=best, run=cpu, gpu_memory_gb=48, **kw).fits
    assert not plan_memory(qwen, batch=best + 1, run=cpu, gpu_memory_gb=48, **kw).fits
    assert largest_batch(qwen, 48, run=Runtime(text_encoder="gpu"), **kw) == 0
    # Batched CFG doubles the DiT's batch; an uncompiled VAE decodes the whole batch at once.
    assert largest_batch(qwen, 48, run=replace(cpu, cfg="batched"), **kw) < best
    assert largest_batch(qwen, 48, run=replace(cpu, vae_batch=None), **kw) < best


# The node self-test's dit_eager lines on an H200 (bf16, 60 blocks, text 128, batch 1): bytes of
# one eager forward above the weights (torch.cuda.max_memory_allocated), by image side.
H200_DIT_ACTIVATIONS = {1328: 0.786e9, 1024: 0.469e9}


@pytest.mark.parametrize("size", sorted(H200_DIT_ACTIVATIONS))
def test_cuda_dit_activations_cover_the_h200_measurement(qwen, size):
    """The CUDA plan stays above what the GPU held, by at most 10% (not a loose bound either)."""
    plan = dit_activation_bytes(qwen.transformer, 1, size, size, 128, 2, device="cuda")
    measured = H200_DIT_ACTIVATIONS[size]
    assert measured <= plan <= 1.10 * measured
    cpu = dit_activation_bytes(qwen.transformer, 1, size, size, 128, 2)
    assert cpu < measured  # the lifetimes alone, which the CPU allocator's peak matches, fall short


def test_math_attention_materialises_the_scores(qwen):
    fused = dit_activation_bytes(qwen.transformer, 1, 1328, 1328, 512, 2)
    math = dit_activation_bytes(qwen.transformer, 1, 1328, 1328, 512, 2, attention="math")
    S = (1328 // 16) ** 2 + 512
    assert math - fused >= 2 * 24 * S * S * 2 - fused


# -- jobs -------------------------------------------------------------------------------------------


@pytest.fixture
def qwen_configs_dir(tmp_path) -> Path:
    """A model folder holding only the published configs (the plan never needs weights)."""
    root = tmp_path / "qwen-image"
    for part in ("transformer", "vae", "text_encoder", "scheduler"):
        shutil.copytree(PUBLISHED / part, root / part)
    return root


def _job(tmp_path: Path, model: Path, **workers) -> Path:
    lines = [
        f"input: {{path: {REPO / 'jobs' / 'examples' / 'prompts.parquet'}}}",
        f"output: {{uri: {tmp_path / 'out'}}}",
        f"model: {{path: {model}, text_encoder: {workers.pop('text_encoder', 'gpu')}, "
        f"quantization: {workers.pop('quantization', 'none')}, fp8_layers: {workers.pop('fp8_layers', 'safe')}, "
        f"modulation_cache: {workers.pop('modulation_cache', 'auto')}}}",
        "buckets: {names: [1328x1328, 1024x1024]}",
        "workers: {" + ", ".join(f"{k}: {v}" for k, v in workers.items()) + "}",
    ]
    path = tmp_path / "job.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_refuses_a_batch_that_cannot_fit_naming_the_largest(tmp_path, qwen_configs_dir, capsys):
    job = _job(tmp_path, qwen_configs_dir, batch_size=64, gpu_memory_gb=48, text_encoder="cpu")
    assert main(["plan", str(job)]) == 2
    out, err = capsys.readouterr()
    assert "memory:" in out and "1328x1328 x64 bf16, text encoder cpu" in out
    assert "bucket 1328x1328: workers.batch_size 64 needs" in err
    assert "the largest batch that fits 48 GB is 5" in err
    assert main(["validate", str(job)]) == 2
    assert "the largest batch that fits 48 GB is 5" in capsys.readouterr().err
    assert main(["run", str(job)]) == 2  # refused before any actor is asked for
    assert not (tmp_path / "out").exists()


def test_text_encoder_on_the_gpu_of_48_gb_is_refused_with_what_to_do(tmp_path, qwen_configs_dir, capsys):
    job = _job(tmp_path, qwen_configs_dir, batch_size=1, gpu_memory_gb=48)
    assert main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert "not even batch 1 fits 48 GB" in err and "model.text_encoder: offload" in err


def test_a_job_that_fits_plans_with_its_memory(tmp_path, qwen_configs_dir, capsys):
    job = _job(tmp_path, qwen_configs_dir, batch_size=2, gpu_memory_gb=48, text_encoder="offload")
    assert main(["plan", str(job), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    mem = info["memory"]
    assert mem["fits"] is True and mem["largest_batch"]["1328x1328"] == 5
    first = mem["buckets"][0]
    assert first["bucket"] == "1328x1328" and first["dit_swapped"] and first["peak_gb"] <= 48
    assert main(["validate", str(job)]) == 0
    assert "memory: fits 48 GB" in capsys.readouterr().out


def test_a_step_cache_keeps_its_tensors_in_the_plan(tmp_path, qwen_configs_dir, capsys):
    """The step cache keeps N x D per image per CFG branch for each of its tensors (signal,
    residual, TaylorSeer derivatives) for the whole schedule: the plan counts them."""
    job = _job(tmp_path, qwen_configs_dir, batch_size=2, gpu_memory_gb=48, text_encoder="offload")
    base = job.read_text()
    exact_largest = None
    for step_cache, tensors in (("off", 0), ("safe", 2), ("fast", 3)):
        job.write_text(base + f"sampling: {{steps: 50, step_cache: {step_cache}}}\n")
        assert main(["plan", str(job), "--json"]) == 0
        mem = json.loads(capsys.readouterr().out)["memory"]
        first = mem["buckets"][0]
        kept = tensors * 2 * 2 * (1328 // 16) ** 2 * 3072 * 2  # tensors x branches x batch x N x D x bf16
        assert first["extra_gb"].get("step_cache", 0) == round(kept / 1e9, 2)
        if exact_largest is None:
            exact_largest = mem["largest_batch"]["1328x1328"]
        else:
            assert mem["largest_batch"]["1328x1328"] <= exact_largest


def test_inspect_reads_headers_and_prints_the_plan(qwen_configs_dir, capsys):
    assert main(["inspect", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["components"]["transformer"]["checkpoint"]["params"]
        == info["components"]["transformer"]["params"]
    )
    assert main(["inspect", str(qwen_configs_dir), "--gpu-gb", "80", "48"]) == 0
    out = capsys.readouterr().out
    assert "transformer    20.430 B params" in out
    assert "1328x1328 x1, text encoder gpu" in out and "48 GB: no (max batch 0)" in out
    assert "text encoder cpu" in out and "48 GB: fits (max batch 5)" in out


@pytest.mark.slow
def test_fp8_halves_the_dit_in_plan_and_inspect_and_a_batch_too_large_is_refused(
    tmp_path, qwen_configs_dir, capsys
):
    # Every linear in FP8 (`all`): the DiT exactly halved; the default set keeps img_mlp.net.2 in
    # bf16 (tests/unit/model/test_fp8_layer_sets.py has its figures). The per-step modulation
    # cache: the GPU default's tables (`auto` -> table) take a little more (test_batch_fit.py).
    fp8 = {"quantization": "fp8", "fp8_layers": "all", "modulation_cache": "cfg"}
    job = _job(tmp_path, qwen_configs_dir, batch_size=9, gpu_memory_gb=48, **fp8)
    assert main(["plan", str(job), "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    first = mem["buckets"][0]
    assert mem["quantization"] == "fp8" and round(first["weights_gb"]["transformer"], 1) == 20.5
    assert mem["fits"] is True and mem["largest_batch"]["1328x1328"] == 9
    # Every GPU size with every text-encoder placement, whatever the job's own GPU.
    by_gpu = mem["largest_batch_by_gpu"]["1328x1328"]
    assert by_gpu["80"] == {"gpu": 40, "cpu": 56, "offload": 56}
    assert by_gpu["48"] == {"gpu": 9, "cpu": 25, "offload": 25}
    assert by_gpu["24"] == {"gpu": 0, "cpu": 0, "offload": 0}  # 1328x1328's VAE decode does not fit
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    assert "in bf16, DiT fp8: transformer 20.5 GB" in out
    assert "largest batch per GPU size (text encoder gpu / cpu / offload):" in out
    assert "1328x1328: 80 GB 40/56/56, 48 GB 9/25/25, 24 GB 0/0/0" in out
    # One more image than fits is refused before any actor, naming the largest that does.
    job = _job(tmp_path, qwen_configs_dir, batch_size=10, gpu_memory_gb=48, **fp8)
    assert main(["plan", str(job)]) == 2
    assert "the largest batch that fits 48 GB is 9" in capsys.readouterr().err
    # bf16 with the text encoder on a 48 GB GPU: not even batch 1; the refusal says FP8 would fit.
    job = _job(tmp_path, qwen_configs_dir, batch_size=1, gpu_memory_gb=48)
    assert main(["validate", str(job)]) == 2
    assert "model.quantization: fp8" in capsys.readouterr().err
    # inspect plans the defaults: the `safe` layer set (img_mlp.net.2 kept in bf16: 2.3 GB more)
    # and a GPU's modulation tables.
    assert main(["inspect", str(qwen_configs_dir), "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "40.86 GB in bf16, 22.76 GB as fp8" in out and "DiT fp8" in out
    assert "text encoder gpu" in out and "48 GB: fits (max batch 6)" in out
    assert "text encoder cpu" in out and "80 GB: fits (max batch 54)" in out
    assert main(["inspect", str(qwen_configs_dir), "--quantization", "fp8-weight-only", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert round(info["components"]["transformer"]["fp8-weight-only_gb"], 1) == 22.8


def test_qwen_plan_numbers_for_the_readme(qwen):
    """The numbers README.md quotes for 1328x1328 (batch 1, bf16)."""
    peaks = {
        te: round(
            plan_memory(
                qwen, height=1328, width=1328, batch=1, run=Runtime(text_encoder=te), gpu_memory_gb=48
            ).peak
            / GB,
            1,
        )
        for te in ("gpu", "cpu", "offload")
    }
    assert peaks == {"gpu": 61.7, "cpu": 45.1, "offload": 45.1}


def test_a_cpu_job_is_planned_in_host_memory_without_the_cuda_reserve(capsys):
    assert main(["plan", str(REPO / "jobs" / "examples" / "tiny.yaml"), "--json"]) == 0  # gpus: 0
    buckets = json.loads(capsys.readouterr().out)["memory"]["buckets"]
    assert {b["device"] for b in buckets} == {"cpu"} and {b["dtype"] for b in buckets} == {"fp32"}
    assert all(b["peak_gb"] < 0.5 for b in buckets)  # a 10 MB model: no 1.5 GiB CUDA context
