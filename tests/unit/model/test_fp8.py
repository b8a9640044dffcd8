"""FP8 DiT weights (model.qwen_image.fp8, model.loading.quantization): the arithmetic, quantize-while-loading, LoRA
merged before quantizing, the per-forward error at published widths, host memory while loading,
and every bad input refused by name before any weight is read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ditfleet.model import load_pipeline
from ditfleet.model.loading.quantization import (
    KEEP_IN_LOAD_DTYPE,
    QuantizationError,
    check_fp8_device,
    fp8_keep,
    keeps_load_dtype,
)
from ditfleet.model.loading.weights import WeightsError
from ditfleet.model.qwen_image.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    Fp8Quantizer,
    quantize_model,
    quantize_rows,
    quantize_weight,
)
from ditfleet.model.qwen_image.lora import LoraSpec, read_lora
from ditfleet.model.tiny.adherence import measure
from ditfleet.testing.models import load_transformer
from ditfleet.testing.outliers import cast_inputs, forward_inputs, outlier_transformer, relative_error
from tests.support.paths import REPO
from tests.unit.model.test_lora import write_diffusers_lora

MODES = ("fp8", "fp8-weight-only")


def test_weight_quantization_is_per_output_channel_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g) * torch.logspace(-3, 2, 40)[:, None]  # rows 5 decades apart
    w8, scale = quantize_weight(w)
    assert w8.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (40,)
    back = w8.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value (normal numbers), and
    # subnormals are 2^-9 of the row's 448 apart; each row's own range sets its step.
    bound = torch.maximum(w.abs() / 16, scale[:, None] * 2**-10)
    assert ((back - w).abs() <= bound * 1.0001).all()
    torch.testing.assert_close(back.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)  # row max: 448 exactly


def test_activation_rows_never_overflow_e4m3():
    x = torch.randn(5, 32, dtype=torch.bfloat16) * torch.tensor([1e-3, 1, 30, 3e3, 1e4])[:, None].bfloat16()
    x8, s = quantize_rows(x)
    assert s.shape == (5, 1) and torch.isfinite(x8.float()).all()
    torch.testing.assert_close((x8.float() * s), x.float(), rtol=0.07, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_linear_is_a_linear_by_name_and_hooks(mode):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    q = Fp8Linear.from_linear(lin, mode)
    assert set(q.state_dict()) == {"weight", "bias", "weight_scale"}
    assert q.weight.dtype == FP8_DTYPE and q.bias.dtype == torch.float32
    calls = []
    q.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, 7, 64)
    err = relative_error(q(x), lin(x).detach())
    assert calls == [1]
    assert err < (0.04 if mode == "fp8" else 0.03), err
    assert q.scaled_mm == (mode == "fp8")
    # A layer torch._scaled_mm cannot take (dims not multiples of 16) runs weight-only.
    assert not Fp8Linear.from_linear(torch.nn.Linear(64, 40), mode).scaled_mm


@pytest.mark.slow
def test_published_width_forward_error_next_to_bf16():
    """One block at Qwen-Image's widths with outlier channels: the relative error of one forward
    against fp32, bf16 activations as on a GPU (bench/fp8.py --part forward measures the same
    at more tokens and blocks; the bounds here are about 1.5x what it measures)."""
    dit = outlier_transformer(num_layers=1, seed=0)
    inputs = forward_inputs(dit, grid=(4, 4), text_len=8)
    with torch.inference_mode():
        ref = dit(**inputs)
    errors = {}
    for variant in ("bf16", *MODES):
        import copy

        model = copy.deepcopy(dit)
        if variant != "bf16":
            quantize_model(model, variant)
        model = model.to(torch.bfloat16) if variant == "bf16" else _kept_to_bf16(model)
        with torch.inference_mode():
            errors[variant] = relative_error(model(**cast_inputs(inputs, torch.bfloat16)), ref)
        del model
    assert errors["bf16"] < 0.01, errors
    assert errors["fp8-weight-only"] < 0.05, errors
    assert errors["fp8"] < 0.06, errors
    assert errors["fp8"] > errors["bf16"] and errors["fp8-weight-only"] > errors["bf16"]


def _kept_to_bf16(model):
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dtype == torch.float32:
                setattr(m, name, torch.nn.Parameter(p.to(torch.bfloat16), requires_grad=False))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_streamed_quantization_equals_quantizing_the_loaded_weights(real_widths_dir, mode):
    """Quantized tensor by tensor while streaming == the bf16 model loaded, then quantized; the
    kept layers (the default layer set's) stay bf16 and every diffusers key is still there."""
    keep = fp8_keep("safe")
    tdir = real_widths_dir / "transformer"
    exact = load_transformer(tdir, "cpu", torch.bfloat16)
    names = {k for k, v in exact.named_modules() if isinstance(v, torch.nn.Linear)}
    quantized = load_transformer(tdir, "cpu", torch.bfloat16, quantization=mode)
    state = quantized.state_dict()
    assert set(state) - set(exact.state_dict()) == {
        f"{n}.weight_scale" for n in names if not keeps_load_dtype(n, keep)
    }
    for n in names:
        layer = quantized.get_submodule(n)
        if keeps_load_dtype(n, keep):
            assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, exact.get_submodule(n).weight)
            continue
        assert isinstance(layer, Fp8Linear) and layer.mode == mode
        w8, scale = quantize_weight(exact.get_submodule(n).weight)
        assert torch.equal(layer.weight.view(torch.uint8), w8.view(torch.uint8)), n
        assert torch.equal(layer.weight_scale, scale), n
        assert torch.equal(layer.bias, exact.get_submodule(n).bias)
    assert quantized.dtype == torch.bfloat16  # the kept embedders carry the activation dtype
    kept = [n for n in names if keeps_load_dtype(n, keep)]
    assert sorted(kept) == sorted(
        ["img_in", "txt_in", "norm_out.linear", "proj_out"]
        + [f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)]
        + [f"transformer_blocks.{i}.img_mlp.net.2" for i in range(len(exact.transformer_blocks))]
    ), kept


@pytest.mark.parametrize("mode", MODES)
def test_lora_is_merged_before_quantizing(tmp_path, random_model_dir, mode):
    """Each layer's LoRA update goes into its weight before that weight is quantized: the loaded
    FP8 model is the merged bf16 model quantized, for quantized and kept layers alike."""
    lora = write_diffusers_lora(tmp_path / "a.safetensors", seed=3, bias=True)
    merged = load_pipeline(random_model_dir, dtype=torch.bfloat16, loras=[LoraSpec(str(lora), 0.7)])
    ours = load_pipeline(
        random_model_dir, dtype=torch.bfloat16, loras=[LoraSpec(str(lora), 0.7)], quantization=mode
    )
    plain = load_pipeline(random_model_dir, dtype=torch.bfloat16, quantization=mode)
    expected = quantize_model(merged.transformer, mode)
    got = ours.transformer.state_dict()
    for k, v in expected.state_dict().items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    # and the adapter did change the quantized weights (to_q is one of its targets)
    q = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(got[q].view(torch.uint8), plain.transformer.state_dict()[q].view(torch.uint8))
    assert ours.model_revision not in (merged.model_revision, plain.model_revision)


def test_quantizer_hands_back_the_updates_of_kept_layers(tmp_path, random_model_dir):
    from ditfleet.model.qwen_image.loader import prepare_transformer
    from ditfleet.model.qwen_image.lora import plan_updates

    lora = write_diffusers_lora(tmp_path / "a.safetensors", seed=1)
    model, _ = prepare_transformer(random_model_dir / "transformer")
    updates = plan_updates([read_lora(LoraSpec(str(lora)))], model)
    quantizer = Fp8Quantizer("fp8", updates)
    quantizer.prepare(model)
    assert {u.module for u in quantizer.unmerged} == {"img_in", "txt_in", "proj_out"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_tiny_pipeline_runs_quantized_and_records_it(mode):
    exact = load_pipeline("tiny", load_text_encoder_too=True)
    pipe = load_pipeline("tiny", quantization=mode)
    kw = dict(
        prompt=["a red circle on a blue background"],
        height=64,
        width=64,
        steps=3,
        true_cfg_scale=2.0,
        seeds=[1],
    )
    a, b = exact.generate(**kw), pipe.generate(**kw)
    assert torch.isfinite(b).all()
    # Other pixels, the same picture. Judged as a whole (PSNR, and the scene the adherence check
    # reads), not by the single worst pixel: a shape's anti-aliased rim moving by one pixel differs by
    # about 0.5 there, and which pixel that is depends on the CPU's FP8 kernel (28.1 dB for fp8 and
    # 31.0 dB weight-only, measured on this picture).
    assert (a != b).any()
    psnr = -10 * torch.log10(((a - b) ** 2).mean())
    assert psnr > 24, f"{mode}: {psnr:.1f} dB against the exact image"
    seen_exact, seen_quantized = measure(a[0]), measure(b[0])
    for attribute in ("background", "color", "position", "kind"):
        assert getattr(seen_quantized, attribute) == getattr(seen_exact, attribute), attribute
    assert pipe.model_revision != exact.model_revision
    assert load_pipeline("tiny", quantization="none").model_revision == exact.model_revision


@pytest.mark.slow
def test_streaming_quantized_load_holds_less_than_one_shard_beyond_the_model(real_widths_dir):
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "load_rss.py"), "--model", str(real_widths_dir),
         "--methods", "streaming", "--quantization", "fp8"],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["shards"] >= 3 and r["quantization"] == "fp8"
    assert r["streaming_ratio"] < 1.3, r
    # the loaded model is FP8 but for the default set's img_mlp.net.2 (1/9 of each block's
    # weights): about 0.56 of the bf16 checkpoint
    assert r["streaming_model_mb"] < 0.62 * r["total_mb"], r


# -- bad input -------------------------------------------------------------------------------------


def test_unknown_quantization_is_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_pipeline("tiny", quantization="int4")
    with pytest.raises(QuantizationError, match="unknown quantization 'fp4'.*fp8-weight-only"):
        Fp8Quantizer("fp4")


@pytest.mark.parametrize(
    ("capability", "ok"), [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)]
)
def test_fp8_needs_fp8_units_and_suggests_weight_only(capability, ok):
    if ok:
        check_fp8_device("fp8", "cuda", capability)
    else:
        with pytest.raises(QuantizationError, match="fp8-weight-only") as e:
            check_fp8_device("fp8", "cuda", capability, "NVIDIA A100-SXM4-80GB")
        assert "A100" in str(e.value) and f"{capability[0]}.{capability[1]}" in str(e.value)
    check_fp8_device("fp8-weight-only", "cuda", capability)  # weight-only runs anywhere
    check_fp8_device("fp8", "cpu", None)


def test_fp8_on_an_a100_is_refused_before_any_gpu_work(monkeypatch):
    """The capability is all that is read: on this CPU-only torch any real CUDA call would fail
    with another error, so reaching QuantizationError proves nothing touched the device."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(QuantizationError, match="A100.*fp8-weight-only"):
        load_pipeline("tiny", device="cuda", quantization="fp8")


def test_fp8_checkpoint_without_scales_is_refused(tmp_path, random_model_dir):
    import shutil

    root = tmp_path / "m"
    shutil.copytree(random_model_dir, root)
    tdir = root / "transformer"
    from safetensors.torch import load_file

    files = sorted(tdir.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
        f.unlink()
    for index in tdir.glob("*.index.json"):
        index.unlink()
    key = "transformer_blocks.0.attn.to_q.weight"
    state[key] = state[key].to(FP8_DTYPE)
    save_file(state, str(tdir / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(WeightsError, match=r"to_q.weight.*the scales are missing"):
        load_pipeline(root, quantization="fp8")
    with pytest.raises(WeightsError, match="scales are missing"):
        load_pipeline(root)  # never cast to bf16 without its scale


def test_keep_list_names_only_real_layers():
    from ditfleet.model.qwen_image.published import published_config
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

    with torch.device("meta"):
        model = QwenImageTransformer(
            TransformerConfig.from_dict(
                {**published_config("qwen-image", "transformer/config.json"), "num_layers": 1}
            )
        )
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for pattern in KEEP_IN_LOAD_DTYPE:
        assert any(keeps_load_dtype(n, (pattern,)) for n in names), pattern
