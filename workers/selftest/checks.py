"""The self-test's first stages: the node, correctness against diffusers and the attention kernels,
each a pass/fail line before any speed number (the compile stage, next, is compile_check's)."""

from __future__ import annotations

import functools
import inspect
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ditfleet.model.generation.pipeline import TextToImagePipeline
from ditfleet.model.generation.sampling import latent_grid, model_timestep
from ditfleet.model.generation.scheduler import sigma_schedule
from ditfleet.model.memory import GB
from ditfleet.workers.selftest.parts import (
    FAMILY,
    config_file,
    diffusers_version,
    dit_inputs,
    free,
    rel_err,
    sizes,
    sync,
    timed_ms,
    transformer_config,
    write_random_transformer,
)
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage
from ditfleet.workers.selftest.sdpa_recorder import SdpaRecorder, summarize_calls

# -- 1. the node -----------------------------------------------------------------------------------


@stage("env", estimate_s=2, limit_s=30)
def env(ctx: Context) -> None:
    """The node: torch, CUDA, GPU, diffusers, the SDPA backends this build enables."""
    line: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(ctx.device),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "diffusers": diffusers_version(),
        "tiny": ctx.tiny,
    }
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    line["torch_ok"] = (major, minor) >= (2, 11) or ctx.tiny
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        line.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gb=round(props.total_memory / GB, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            sdpa_enabled={
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                "math": torch.backends.cuda.math_sdp_enabled(),
            },
        )
    ctx.emit({"status": "pass" if line["torch_ok"] else "fail", **line})


@stage("matmul_ceiling", estimate_s=8, limit_s=30)
def matmul_ceiling(ctx: Context) -> None:
    """The bf16 dense matmul ceiling of this GPU, measured now: what "% of peak" lines divide by."""
    n = 512 if ctx.tiny else 8192
    shapes = [(n, n, n)] if ctx.tiny else [(n, n, n), (8192, 3072, 12288), (8192, 12288, 3072)]
    best, per_shape = 0.0, {}
    for m, k, nn in shapes:
        a = torch.randn(m, k, device=ctx.device, dtype=ctx.dtype)
        b = torch.randn(k, nn, device=ctx.device, dtype=ctx.dtype)
        ms = timed_ms(ctx, functools.partial(torch.mm, a, b), repeat=3 if ctx.tiny else 20, warm=3)
        tflops = 2 * m * k * nn / (ms / 1000) / 1e12
        per_shape[f"{m}x{k}x{nn}"] = round(tflops, 1)
        best = max(best, tflops)
        del a, b
    ctx.state["ceiling_tflops"] = best
    ctx.emit({"status": "measured", "tflops": round(best, 1), "per_shape_tflops": per_shape})


# -- 2. correctness ----------------------------------------------------------------------------------


def write_slice(ctx: Context, root: Path) -> Path:
    """The hub layout at the slice's depth: transformer shards + index, the VAE in diffusers' 3D
    layout, the published scheduler; random weights, no text encoder."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(FAMILY.published_dir / "model_index.json", root / "model_index.json")
    (root / "scheduler").mkdir(exist_ok=True)
    shutil.copy(FAMILY.published_dir / "scheduler" / "scheduler_config.json", root / "scheduler")
    cfg = transformer_config(ctx, ctx.args.slice_blocks)
    shard_bytes = 2**20 if ctx.tiny else 512 * 2**20
    write_random_transformer(root / "transformer", cfg.to_dict(), shard_bytes)
    FAMILY.write_random_vae(root / "vae", config_file(ctx, "vae/config.json"))
    return root


def slice_root(ctx: Context) -> Path:
    assert ctx.scratch is not None
    return ctx.scratch / "slice"


def slice_pipe(ctx: Context) -> TextToImagePipeline:
    """The slice's pipeline: the correctness stage's, or (a stage run on its own, in a child
    process) loaded again from the shards it wrote, written first if they are not there."""
    pipe = ctx.state.get("slice_pipe")
    if pipe is not None:
        return pipe
    from ditfleet.model.family import load_pipeline

    root = slice_root(ctx)
    if not (root / "model_index.json").exists():
        write_slice(ctx, root)
    pipe = load_pipeline(
        root, device=ctx.device, dtype=ctx.dtype, load_text_encoder_too=False, model_id="selftest-slice"
    )
    ctx.state["slice_pipe"] = pipe
    return pipe


def _diffusers_forward(ref, x, txt, t, shapes):
    params = inspect.signature(ref.forward).parameters
    kwargs = dict(
        hidden_states=x, encoder_hidden_states=txt, timestep=t, img_shapes=shapes, return_dict=False
    )
    if "encoder_hidden_states_mask" in params:
        kwargs["encoder_hidden_states_mask"] = None
    if "txt_seq_lens" in params:  # older releases need it, newer ones deprecate it
        kwargs["txt_seq_lens"] = [txt.shape[1]] * x.shape[0]
    return ref(**kwargs)[0]


def _side_by_side(
    check: str, version: str, got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor, **where: int
) -> dict[str, Any]:
    """The line of one check against diffusers: ours (`got`) against diffusers in the same dtype
    (`want`) and in fp32 (`exact`). It passes within 1% of diffusers, or no further from fp32 than
    diffusers' own run in this dtype is (rounding in the dtype is then the whole difference)."""
    ours_vs_ref, ours_vs_fp32, ref_vs_fp32 = rel_err(got, want), rel_err(got, exact), rel_err(want, exact)
    limit = 0.01
    passes = ours_vs_ref <= limit or ours_vs_fp32 <= 1.25 * ref_vs_fp32 + 1e-3
    return {
        "status": "pass" if passes else "fail",
        "check": check,
        "diffusers": version,
        **where,
        "rel_err": round(ours_vs_ref, 5),
        "rel_err_vs_fp32": round(ours_vs_fp32, 5),
        "diffusers_rel_err_vs_fp32": round(ref_vs_fp32, 5),
        "limit": limit,
    }


@stage("correctness", estimate_s=30, limit_s=90, check=True)
def correctness(ctx: Context) -> None:
    """The real-width slice loaded from hub-style shards, then ours vs diffusers in the run's dtype:
    DiT output, VAE decode, the timestep trajectory."""
    t0 = time.perf_counter()
    root = write_slice(ctx, slice_root(ctx))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx.state.pop("slice_pipe", None)
    pipe = slice_pipe(ctx)  # loaded from the shards just written
    sync(ctx.device)
    load_s = time.perf_counter() - t0
    files = sorted(p.name for p in (root / "transformer").iterdir())
    ctx.emit(
        {
            "status": "pass",
            "check": "hub_layout_load",
            "blocks": pipe.transformer.config.num_layers,
            "files": len(files),
            "write_s": round(write_s, 1),
            "load_s": round(load_s, 2),
        }
    )
    version = diffusers_version()
    if version is None:
        raise StageSkipped(
            "diffusers is not importable: the side-by-side checks need it (docs/performance.md: bring its wheel)"
        )
    ctx.check("diffusers")
    size, text_len = (64, 8) if ctx.tiny else (512, 64)
    ours: Any = pipe.transformer  # the family's DiT as parts builds it
    x, txt, shapes = dit_inputs(ours.config, size, text_len, 1, ctx.device, ctx.dtype)
    t = torch.full((1,), 0.7, device=ctx.device, dtype=ctx.dtype)
    with torch.no_grad():
        got = ours(x, txt, None, t, shapes)
        ref = FAMILY.reference_transformer(ours, ctx.dtype)
        want = _diffusers_forward(ref, x, txt, t, shapes)
        del ref
        ref32 = FAMILY.reference_transformer(ours, torch.float32)
        exact = _diffusers_forward(ref32, x.float(), txt.float(), t.float(), shapes)
        del ref32
    ctx.emit(_side_by_side("dit_vs_diffusers", version, got, want, exact, size=size, text_len=text_len))
    free(ctx)
    ctx.check("vae")
    _vae_vs_diffusers(ctx, pipe, root, version)
    _trajectory_vs_diffusers(ctx, pipe, root)


def _vae_vs_diffusers(ctx: Context, pipe: TextToImagePipeline, root: Path, version: str) -> None:
    from diffusers import AutoencoderKLQwenImage

    size = 64 if ctx.tiny else 512
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 16, size // 8, size // 8, generator=g).to(ctx.device, ctx.dtype)
    results = {}
    vae = pipe.vae
    with torch.no_grad():
        got = vae.decode(z)
        for dtype in (ctx.dtype, torch.float32):
            ref = (
                AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype).to(ctx.device).eval()
            )
            results[dtype] = ref.decode(z.to(dtype)[:, :, None]).sample[:, :, 0]
            del ref
    ctx.emit(
        _side_by_side("vae_vs_diffusers", version, got, results[ctx.dtype], results[torch.float32], size=size)
    )


def _trajectory_vs_diffusers(ctx: Context, pipe: TextToImagePipeline, root: Path) -> None:
    """The timesteps the DiT sees, in the run's dtype, step by step against QwenImagePipeline's."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    try:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    except ImportError as e:
        raise StageSkipped(f"this diffusers has no Qwen-Image pipeline: {e}") from e
    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler")
    c = ref.config
    mismatched = {}
    for steps, size in ((50, 1328), (50, 1024), (20, 1328)):
        seq = latent_grid(size, size)[0] * latent_grid(size, size)[1]
        mu = calculate_shift(
            seq,
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        ref.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        # diffusers hands the DiT t.expand(B).to(latents.dtype) / 1000 (QwenImagePipeline)
        want = [t.to(ctx.dtype) / 1000 for t in ref.timesteps.reshape(-1, 1)]
        sigmas = sigma_schedule(pipe.scheduler, steps, seq)
        got = [model_timestep(t, ctx.dtype) for t in (sigmas[:-1] * 1000.0).reshape(-1, 1)]
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a.cpu(), b.cpu())]
        if bad or len(got) != len(want):
            mismatched[f"{steps}@{size}"] = bad[:5]
    ctx.emit(
        {
            "status": "fail" if mismatched else "pass",
            "check": "timestep_trajectory",
            "dtype": str(ctx.dtype).removeprefix("torch."),
            "mismatched_steps": mismatched,
        }
    )


# -- 3. the attention kernels -----------------------------------------------------------------------


@stage("sdpa_backends", estimate_s=10, limit_s=60, check=True)
def sdpa_backends(ctx: Context) -> None:
    """Every SDPA call of one CFG step (a padded batch of 2) and one VAE decode: the backend of
    each; zero calls may take the math path."""
    pipe = slice_pipe(ctx)
    size = 64 if ctx.tiny else 512
    width = FAMILY.text_conditioning(pipe).width
    g = torch.Generator().manual_seed(5)
    long, short = (8, 5) if ctx.tiny else (64, 40)
    embeds = torch.randn(2, long, width, generator=g)
    mask = torch.ones(2, long, dtype=torch.long)
    mask[1, short:] = 0
    neg = torch.randn(1, 3, width, generator=g).expand(2, -1, -1)
    recorder = SdpaRecorder(fused_only=ctx.cuda)
    with recorder.active(), torch.no_grad():
        pipe.generate(
            prompt_embeds=embeds,
            prompt_embeds_mask=mask,
            negative_prompt_embeds=neg,
            negative_prompt_embeds_mask=None,
            height=size,
            width=size,
            steps=1,
            true_cfg_scale=4.0,
            seeds=[0, 1],
        )
        sync(ctx.device)
    groups = summarize_calls(recorder.calls)
    math_calls = sum(g["calls"] for g in groups if g["backend"] in ("math", "none"))
    sites = {g["site"] for g in groups}
    ok = math_calls == 0 and {"dit", "vae"} <= sites
    # On the CPU the math path is a fact of the platform (no fused kernel for every shape): reported, not failed.
    status = "pass" if ok else ("fail" if ctx.cuda else "measured")
    ctx.emit({"status": status, "calls": len(recorder.calls), "math_calls": math_calls, "by_call": groups})


@stage("sdpa_speed", estimate_s=5, limit_s=30)
def sdpa_speed(ctx: Context) -> None:
    """ms per SDPA call of the DiT's joint attention at the main bucket (batch 1, text 128), once
    per fused backend alone (cuDNN, flash, efficient), and the fastest."""
    if not ctx.cuda:
        raise StageSkipped("not on CPU: the fused SDPA kernels are CUDA's")
    from torch.nn.attention import sdpa_kernel

    from ditfleet.model.generation.attention_backend import _backend

    cfg = transformer_config(ctx, 1)
    h, w = latent_grid(sizes(ctx)[0], sizes(ctx)[0])
    tokens = h * w + ctx.args.text_len
    g = torch.Generator(device=ctx.device).manual_seed(11)
    heads, head_dim = FAMILY.attention_shape(cfg.to_dict())
    shape = (1, heads, tokens, head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=ctx.device, dtype=ctx.dtype) for _ in range(3))
    ms: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for name in ("cudnn", "flash", "efficient"):
        ctx.check(name)
        try:
            with sdpa_kernel([_backend(name)]):
                ms[name] = timed_ms(
                    ctx, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 10, warm=2
                )
        except RuntimeError as e:
            ms[name] = None
            errors[name] = str(e).splitlines()[0][:200]
    timed = {k: v for k, v in ms.items() if v is not None}
    ctx.emit(
        {
            "status": "measured",
            "size": f"{sizes(ctx)[0]}x{sizes(ctx)[0]}",
            "q": list(q.shape),
            "ms_per_call": ms,
            "errors": errors,
            "fastest": min(timed, key=timed.__getitem__) if timed else None,
        }
    )
