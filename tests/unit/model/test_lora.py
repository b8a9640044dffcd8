"""LoRA adapters merged at load compute what diffusers' `load_lora_weights` + `fuse_lora` compute:
the same merged weights (bit for bit on CPU) and the same images, for every key layout diffusers'
Qwen-Image loader reads; bad adapters fail before any weight is read, naming the file and keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.lora import LoraError, LoraSpec
from ditfleet.model.qwen_image.published import PUBLISHED
from tests.support.model_fixtures import diffusers_images, diffusers_pipeline, padded_embeds
from tests.support.paths import REPO

LIGHTNING_SCHEDULER = PUBLISHED / "qwen-image-lightning" / "scheduler"
RANK = 4
# Linear layers of the tiny transformer (inner 48, text 16) that the test adapters touch:
# attention, MLPs and modulation in both blocks, and the top-level projections.
TARGETS = {
    "transformer_blocks.0.attn.to_q": (48, 48),
    "transformer_blocks.0.attn.add_k_proj": (48, 48),
    "transformer_blocks.0.attn.to_out.0": (48, 48),
    "transformer_blocks.0.img_mlp.net.0.proj": (192, 48),
    "transformer_blocks.1.attn.to_v": (48, 48),
    "transformer_blocks.1.attn.to_add_out": (48, 48),
    "transformer_blocks.1.txt_mlp.net.2": (48, 192),
    "transformer_blocks.1.img_mod.1": (288, 48),
    "img_in": (48, 64),
    "txt_in": (48, 16),
    "proj_out": (64, 48),
}


def _factors(seed: int, dtype=torch.float32) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A (rank, in), B (out, rank)), big enough to change the images visibly."""
    g = torch.Generator().manual_seed(seed)
    return {
        m: (
            (torch.randn(RANK, i, generator=g) * 0.2).to(dtype),
            (torch.randn(o, RANK, generator=g) * 0.2).to(dtype),
        )
        for m, (o, i) in TARGETS.items()
    }


def write_diffusers_lora(path: Path, seed: int, dtype=torch.float32, bias: bool = False) -> Path:
    """The layout diffusers' save_lora_weights writes: transformer.<module>.lora_A/B.weight."""
    sd = {}
    for m, (a, b) in _factors(seed, dtype).items():
        sd[f"transformer.{m}.lora_A.weight"] = a
        sd[f"transformer.{m}.lora_B.weight"] = b
        if bias:
            sd[f"transformer.{m}.lora_B.bias"] = (
                torch.randn(b.shape[0], generator=torch.Generator().manual_seed(seed)) * 0.1
            )
    save_file(sd, str(path))
    return path


def write_kohya_lora(path: Path, seed: int, flat: bool, dtype=torch.float32) -> Path:
    """lora_down/lora_up with an alpha per layer; `flat`: lora_unet_ names with underscores,
    else the ComfyUI `diffusion_model.` prefix."""
    sd = {}
    for i, (m, (a, b)) in enumerate(_factors(seed, dtype).items()):
        name = "lora_unet_" + m.replace(".", "_") if flat else f"diffusion_model.{m}"
        sd[f"{name}.lora_down.weight"] = a
        sd[f"{name}.lora_up.weight"] = b
        sd[f"{name}.alpha"] = torch.tensor(float(1 + i % 3 * 3))  # alpha / rank: 0.25, 1, 1.75
    save_file(sd, str(path))
    return path


def write_peft_default_lora(path: Path, seed: int) -> Path:
    """PEFT's adapter-named keys (lora_A.default.weight), bare module names."""
    sd = {}
    for m, (a, b) in _factors(seed).items():
        sd[f"{m}.lora_A.default.weight"] = a
        sd[f"{m}.lora_B.default.weight"] = b
    save_file(sd, str(path))
    return path


def write_lora_with_metadata(path: Path, seed: int) -> Path:
    """Saved by diffusers with its PEFT config in the header: lora_alpha 8 for rank 4 (scaling 2),
    one layer with its own alpha through alpha_pattern."""
    from diffusers import QwenImagePipeline

    layers = {}
    for m, (a, b) in _factors(seed).items():
        layers[f"{m}.lora_A.weight"] = a
        layers[f"{m}.lora_B.weight"] = b
    metadata = {
        "r": RANK,
        "lora_alpha": 8,
        "alpha_pattern": {"transformer_blocks.1.attn.to_v": 2},
        "rank_pattern": {},
        "target_modules": sorted(TARGETS),
    }
    QwenImagePipeline.save_lora_weights(
        path.parent,
        transformer_lora_layers=layers,
        weight_name=path.name,
        transformer_lora_adapter_metadata=metadata,
    )
    return path


def _reference(root: Path, loras: list[tuple[Path, float]], dtype=torch.float32, scheduler=None):
    """diffusers' pipeline with the adapters loaded and fused, LoRA layers then unloaded."""
    ref = diffusers_pipeline(root)
    ref.transformer.to(dtype)
    if scheduler is not None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        ref.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler)
    names = [f"a{i}" for i in range(len(loras))]
    for name, (path, _) in zip(names, loras):
        ref.load_lora_weights(str(path), adapter_name=name)
    ref.set_adapters(names, [s for _, s in loras])
    ref.fuse_lora(adapter_names=names)
    ref.unload_lora_weights()
    return ref


def _assert_same_weights(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    got, want = ours.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    differ = [k for k in want if not torch.equal(got[k], want[k].to(got[k].dtype))]
    assert not differ, differ[:10]


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda p: write_diffusers_lora(p, 1), id="diffusers"),
        pytest.param(lambda p: write_diffusers_lora(p, 1, bias=True), id="diffusers-lora-bias"),
        pytest.param(lambda p: write_kohya_lora(p, 2, flat=True), id="kohya-lora_unet-alpha"),
        pytest.param(lambda p: write_kohya_lora(p, 3, flat=False), id="comfyui-diffusion_model-alpha"),
        pytest.param(lambda p: write_peft_default_lora(p, 4), id="peft-default"),
        pytest.param(lambda p: write_lora_with_metadata(p, 5), id="diffusers-metadata-alpha"),
    ],
)
def test_merged_weights_equal_diffusers_fuse_lora(tmp_path, random_model_dir, write):
    path = write(tmp_path / "adapter.safetensors")
    ref = _reference(random_model_dir, [(path, 0.8)])
    pipe = load_pipeline(random_model_dir, loras=[LoraSpec(str(path), 0.8)], load_text_encoder_too=False)
    base = load_pipeline(random_model_dir, load_text_encoder_too=False)
    _assert_same_weights(pipe.transformer, ref.transformer)
    # The adapter did change every layer it names (the comparison above is not vacuous).
    changed = {
        k.removesuffix(".weight")
        for k, v in pipe.transformer.state_dict().items()
        if not torch.equal(v, base.transformer.state_dict()[k])
    }
    assert set(TARGETS) <= changed


def test_two_adapters_in_bf16_equal_diffusers_bit_for_bit(tmp_path, random_model_dir):
    """Two adapters (one stored in bf16, one in fp32 with alphas), their own scales, a bf16 model."""
    a = write_diffusers_lora(tmp_path / "a.safetensors", 6, dtype=torch.bfloat16)
    b = write_kohya_lora(tmp_path / "b.safetensors", 7, flat=True)
    ref = _reference(random_model_dir, [(a, 0.7), (b, 1.3)], dtype=torch.bfloat16)
    pipe = load_pipeline(
        random_model_dir,
        dtype=torch.bfloat16,
        loras=[LoraSpec(str(a), 0.7), LoraSpec(str(b), 1.3)],
        load_text_encoder_too=False,
    )
    _assert_same_weights(pipe.transformer, ref.transformer)


@pytest.mark.slow
def test_lightning_lora_form_makes_diffusers_images(tmp_path, random_model_dir):
    """The LoRA form of a few-step distilled model: base weights + adapter + the distilled
    scheduler config, 4 steps, CFG off. Same images as diffusers set up the same way."""
    path = write_kohya_lora(tmp_path / "lightning.safetensors", 8, flat=False)
    pos, mask = padded_embeds(0, [6, 3])
    seeds = [21, 22]
    ref = _reference(random_model_dir, [(path, 1.0)], scheduler=LIGHTNING_SCHEDULER)
    inputs = dict(prompt_embeds=pos, prompt_embeds_mask=mask, height=64, width=96, true_cfg_scale=1.0)
    expected = diffusers_images(ref, steps=4, seeds=seeds, **inputs)
    pipe = load_pipeline(
        random_model_dir,
        loras=[LoraSpec(str(path))],
        scheduler_config=LIGHTNING_SCHEDULER / "scheduler_config.json",
    )
    got = pipe.generate(**inputs, steps=4, seeds=seeds)
    assert got.shape == expected.shape == (2, 3, 64, 96)
    assert (got - expected).abs().max().item() <= 1e-3
    base = load_pipeline(random_model_dir).generate(**inputs, steps=4, seeds=seeds)
    assert (base - got).abs().max().item() > 0.05  # the adapter and the schedule do change the images


def test_revision_names_the_adapters_and_the_schedule(tmp_path, random_model_dir):
    a = write_diffusers_lora(tmp_path / "a.safetensors", 1)
    b = write_diffusers_lora(tmp_path / "b.safetensors", 2)  # same shapes, other values
    kw = dict(load_text_encoder_too=False)
    base = load_pipeline(random_model_dir, **kw).model_revision
    with_a = load_pipeline(random_model_dir, loras=[LoraSpec(str(a))], **kw).model_revision
    assert with_a == load_pipeline(random_model_dir, loras=[LoraSpec(str(a))], **kw).model_revision
    others = [
        load_pipeline(random_model_dir, loras=[LoraSpec(str(b))], **kw).model_revision,
        load_pipeline(random_model_dir, loras=[LoraSpec(str(a), 0.5)], **kw).model_revision,
        load_pipeline(random_model_dir, loras=[LoraSpec(str(a)), LoraSpec(str(b))], **kw).model_revision,
        load_pipeline(random_model_dir, scheduler_config=LIGHTNING_SCHEDULER, **kw).model_revision,
    ]
    assert len({base, with_a, *others}) == 6


# -- bad adapters ---------------------------------------------------------------------------------


def _bad(path: Path, sd: dict) -> Path:
    save_file(sd, str(path))
    return path


def _load_to_cuda(root: Path, path: Path):
    """device="cuda" on purpose: the adapter must be refused before anything is read onto a device
    (on a machine without CUDA, any device work would raise another error)."""
    return load_pipeline(root, device="cuda", loras=[LoraSpec(str(path))], load_text_encoder_too=False)


def test_missing_file_is_named(tmp_path, random_model_dir):
    with pytest.raises(LoraError, match=r"nope\.safetensors: no such file"):
        _load_to_cuda(random_model_dir, tmp_path / "nope.safetensors")


def test_lora_of_another_model_matches_nothing(tmp_path, random_model_dir):
    a, b = torch.zeros(RANK, 48), torch.zeros(48, RANK)
    path = _bad(
        tmp_path / "flux.safetensors",
        {
            "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": a,
            "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": b,
        },
    )
    with pytest.raises(LoraError, match=r"flux\.safetensors: none of its 2 keys name a linear layer") as e:
        _load_to_cuda(random_model_dir, path)
    assert "single_transformer_blocks.0.attn.to_q.lora_A.weight" in str(e.value)


def test_partly_matching_lora_names_the_unmatched_keys(tmp_path, random_model_dir):
    sd = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(RANK, 48),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(48, RANK),
        "transformer.transformer_blocks.7.attn.to_q.lora_A.weight": torch.zeros(RANK, 48),
        "transformer.transformer_blocks.7.attn.to_q.lora_B.weight": torch.zeros(48, RANK),
        "text_encoder.layers.0.q_proj.lora_A.weight": torch.zeros(RANK, 16),
        "text_encoder.layers.0.q_proj.lora_B.weight": torch.zeros(16, RANK),
    }
    with pytest.raises(LoraError, match=r"part\.safetensors: 4 of its 6 keys") as e:
        _load_to_cuda(random_model_dir, _bad(tmp_path / "part.safetensors", sd))
    listed = str(e.value).split("Qwen-Image LoRA keys look like")[0]  # the rest is an example
    assert "transformer.transformer_blocks.7.attn.to_q.lora_A.weight" in listed
    assert "text_encoder.layers.0.q_proj.lora_B.weight" in listed
    assert "transformer_blocks.0.attn" not in listed  # the layer that matches is not listed


def test_shape_mismatch_names_key_and_layer(tmp_path, random_model_dir):
    sd = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(RANK, 3072),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, RANK),
    }
    with pytest.raises(
        LoraError, match=r"wide\.safetensors: transformer\.transformer_blocks\.0\.attn\.to_q"
    ) as e:
        _load_to_cuda(random_model_dir, _bad(tmp_path / "wide.safetensors", sd))
    assert "3072x3072 update" in str(e.value) and "is 48x48" in str(e.value)


@pytest.mark.parametrize(
    "sd, message",
    [
        ({"transformer.img_in.lora_A.weight": torch.zeros(RANK, 64)}, r"img_in has .* but no lora_B"),
        (
            {
                "img_in.lora_A.weight": torch.zeros(RANK, 64),
                "img_in.lora_B.weight": torch.zeros(48, RANK + 1),
            },
            "do not form a rank-r update",
        ),
        ({"img_in.weight": torch.zeros(48, 64)}, r"not LoRA factors .*'img_in\.weight'"),
        ({"img_in.dora_scale": torch.zeros(1, 64)}, "DoRA"),
    ],
)
def test_malformed_lora_is_refused(tmp_path, random_model_dir, sd, message):
    with pytest.raises(LoraError, match=message) as e:
        _load_to_cuda(random_model_dir, _bad(tmp_path / "bad.safetensors", sd))
    assert str(tmp_path / "bad.safetensors") in str(e.value)


def test_not_safetensors_is_refused(tmp_path, random_model_dir):
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(LoraError, match=r"junk\.safetensors: not a readable safetensors file"):
        _load_to_cuda(random_model_dir, tmp_path / "junk.safetensors")
    (tmp_path / "pickled.pt").write_bytes(b"")
    with pytest.raises(LoraError, match=r"pickled\.pt: pickle files"):
        _load_to_cuda(random_model_dir, tmp_path / "pickled.pt")


def test_metadata_rank_must_match_the_factors(tmp_path, random_model_dir):
    sd = {"img_in.lora_A.weight": torch.zeros(RANK, 64), "img_in.lora_B.weight": torch.zeros(48, RANK)}
    path = tmp_path / "meta.safetensors"
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 8})})
    with pytest.raises(LoraError, match=r"meta\.safetensors: img_in: its metadata says rank 8"):
        _load_to_cuda(random_model_dir, path)


# -- through the worker ---------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_style_keys_match_the_published_full_depth_model(tmp_path):
    """Every linear layer of the 60 blocks of the published Qwen-Image transformer (built on the
    meta device), named the way the Lightning LoRA files name them (bare module names,
    lora_down/lora_up, an alpha each) and in the kohya spelling: all matched, none left over."""
    from ditfleet.model.qwen_image.lora import plan_updates, read_lora
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

    published = PUBLISHED / "qwen-image" / "transformer" / "config.json"
    config = TransformerConfig.from_dict(json.loads(published.read_text()), where=str(published))
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")
    }
    assert len(linears) == 60 * 14  # q/k/v, add_q/k/v, to_out, to_add_out, img/txt mod, 2 MLPs x 2
    for flat in (False, True):
        sd = {}
        for name, m in linears.items():  # rank 1 in bf16 keeps the file small (17 MB)
            raw = "lora_unet_" + name.replace(".", "_") if flat else name
            sd[f"{raw}.lora_down.weight"] = torch.zeros(1, m.in_features, dtype=torch.bfloat16)
            sd[f"{raw}.lora_up.weight"] = torch.zeros(m.out_features, 1, dtype=torch.bfloat16)
            sd[f"{raw}.alpha"] = torch.tensor(1.0)
        path = _bad(tmp_path / f"lightning-{flat}.safetensors", sd)
        updates = plan_updates([read_lora(LoraSpec(str(path)))], model)
        assert sorted(u.module for u in updates) == sorted(linears)


@pytest.mark.slow
def test_bench_script_prints_one_json_line():
    """bench/lora_merge.py at the published widths, one block, rank 4 (seconds on CPU)."""
    import subprocess
    import sys

    root = REPO
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "lora_merge.py"), "--rank", "4", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=root,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "lora_merge" and result["adapted_layers"] == 14 and result["rank"] == 4
    assert result["merge_s"] > 0 and result["estimate_60_blocks_s"] > 0
