"""The self-test's stages, most valuable first: correctness on the device, then the speed numbers.

Every stage emits its own JSON lines (runner.Context.emit). Sizes: the real model's widths
(published Qwen-Image configs) unless `--tiny`, which runs the same code at toy widths on the CPU
(the test suite's smoke run). Weights are made on the device in the run's dtype (random, seeded):
nothing multi-GB goes through the disk; the hub-layout loading path is covered by one slice of
`--slice-blocks` blocks written as shards + index and loaded with `load_pipeline`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import math
import platform
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ditfleet.compile.config import CompileConfig
from ditfleet.compile.counting import compile_count
from ditfleet.compile.policy import apply_compile
from ditfleet.model.attention_backend import BACKEND_NAMES, sdpa_choice
from ditfleet.model.memory import GB, ModelMemory, plan_memory
from ditfleet.model.pipeline import TextToImagePipeline
from ditfleet.model.sampling import LATENT_CHANNELS, euler_step, latent_grid, model_timestep, true_cfg
from ditfleet.model.scheduler import sigma_schedule
from ditfleet.model.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.vae import QwenImageVAE, save_vae
from ditfleet.model.vae_config import VAEConfig
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage

log = logging.getLogger("ditfleet.selftest")

PUBLISHED_MODEL = "qwen-image"
TINY_TRANSFORMER = dict(
    num_layers=4,
    num_attention_heads=2,
    attention_head_dim=32,
    joint_attention_dim=32,
    axes_dims_rope=(8, 12, 12),
)
TINY_VAE = dict(base_dim=16, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=1)


# -- configs, weights, timing ----------------------------------------------------------------------


def transformer_config(ctx: Context, layers: int) -> TransformerConfig:
    if ctx.tiny:
        return TransformerConfig(**{**TINY_TRANSFORMER, "num_layers": layers})
    from ditfleet.testing.real_widths import published_config

    return TransformerConfig.from_dict(
        {**published_config(PUBLISHED_MODEL, "transformer/config.json"), "num_layers": layers}
    )


def vae_config(ctx: Context) -> VAEConfig:
    if ctx.tiny:
        return VAEConfig(**TINY_VAE)
    from ditfleet.testing.real_widths import published_config

    return VAEConfig.from_dict(published_config(PUBLISHED_MODEL, "vae/config.json"))


def sizes(ctx: Context) -> list[int]:
    """Square image sides of the speed lines, the bucket the worker uses most first."""
    return [64, 96] if ctx.tiny else list(ctx.args.sizes)


def init_on_device(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill an allocated (uninitialised) module in place on its device: nn.Linear's default range
    for matrices and biases, norm scales around 1. Seeded, so every run draws the same model."""
    g = None
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point():
            continue
        if g is None or g.device != p.device:
            g = torch.Generator(device=p.device).manual_seed(seed)
        with torch.no_grad():
            if name.endswith("weight") and p.dim() == 1 or "gamma" in name:
                p.normal_(1.0, 0.1, generator=g)
            else:
                fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else p.shape[0]
                p.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=g)
    return module


def make_transformer(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> QwenImageTransformer:
    """The DiT straight on the device in `dtype`: built on meta, allocated there, filled there."""
    with torch.device("meta"):
        model = QwenImageTransformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    return init_on_device(model, seed).eval().requires_grad_(False)


def make_vae(
    cfg: VAEConfig, device: torch.device, dtype: torch.dtype, with_encoder: bool, seed: int = 0
) -> QwenImageVAE:
    with torch.device("meta"):
        vae = QwenImageVAE(cfg, with_encoder=with_encoder)
    vae = vae.to(dtype).to_empty(device=device)
    return init_on_device(vae, seed).eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(ctx: Context, fn: Callable[[], object], repeat: int, warm: int = 1) -> float:
    """Median wall ms of `repeat` calls after `warm` calls, the device synchronised."""
    for _ in range(warm):
        fn()
    sync(ctx.device)
    times = []
    for _ in range(max(1, repeat)):
        ctx.check("timing")
        t0 = time.perf_counter()
        fn()
        sync(ctx.device)
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def forward_flops(cfg: TransformerConfig, batch: int, img_tokens: int, txt_tokens: int) -> float:
    """FLOPs (2 per multiply-add) of one DiT forward: block linears, attention, modulation, embeds."""
    D, T = cfg.inner_dim, img_tokens + txt_tokens
    linear = 2 * T * (4 * D * D + 2 * 4 * D * D)  # q, k, v, out + the 4x MLP, both streams together
    attention = 2 * 2 * T * T * D
    modulation = 2 * 2 * D * 6 * D
    embed = 2 * (img_tokens * cfg.in_channels * D + txt_tokens * cfg.joint_attention_dim * D)
    return float(batch * (cfg.num_layers * (linear + attention + modulation) + embed))


def dit_inputs(cfg: TransformerConfig, size: int, text_len: int, batch: int, device, dtype, seed: int = 0):
    h, w = latent_grid(size, size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, h * w, 4 * LATENT_CHANNELS, generator=g).to(device, dtype)
    txt = torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g).to(device, dtype)
    return x, txt, [[(1, h, w)]] * batch


def diffusers_version() -> str | None:
    try:
        import diffusers
    except Exception:  # noqa: BLE001 - absent or broken: the lines that need it say so
        return None
    return diffusers.__version__


def free(ctx: Context, *names: str) -> None:
    for name in names:
        ctx.state.pop(name, None)
    if ctx.cuda:
        torch.cuda.empty_cache()


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
        ms = timed_ms(ctx, lambda a=a, b=b: torch.mm(a, b), repeat=3 if ctx.tiny else 20, warm=3)
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
    from ditfleet.testing import PUBLISHED
    from ditfleet.testing.real_widths import write_random_transformer

    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PUBLISHED / PUBLISHED_MODEL / "model_index.json", root / "model_index.json")
    (root / "scheduler").mkdir(exist_ok=True)
    shutil.copy(PUBLISHED / PUBLISHED_MODEL / "scheduler" / "scheduler_config.json", root / "scheduler")
    cfg = transformer_config(ctx, ctx.args.slice_blocks)
    shard_bytes = 2**20 if ctx.tiny else 512 * 2**20
    write_random_transformer(root / "transformer", cfg.to_dict(), shard_bytes)
    torch.manual_seed(0)
    save_vae(QwenImageVAE(vae_config(ctx), with_encoder=True).to(torch.bfloat16), root / "vae")
    return root


def _diffusers_transformer(ours: QwenImageTransformer, dtype: torch.dtype):
    """diffusers' transformer on `ours`' weights (cast to `dtype`; shared when the dtype is the
    same). `from_config` drops keys an older release does not know, so its constructor never
    sees arguments it lacks."""
    from diffusers import QwenImageTransformer2DModel

    config = {k: v for k, v in ours.config.to_dict().items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel.from_config(config)
    state = {k: v.to(dtype) for k, v in ours.state_dict().items()}
    ref.load_state_dict(state, assign=True, strict=True)
    # Its RoPE tables are computed at construction (on meta here): build them again for real.
    pos = ref.pos_embed
    params = inspect.signature(type(pos)).parameters
    kwargs = {"theta": 10000, "axes_dim": list(ours.config.axes_dims_rope), "scale_rope": True}
    ref.pos_embed = type(pos)(**{k: v for k, v in kwargs.items() if k in params})
    return ref.to(ours.img_in.weight.device).eval().requires_grad_(False)


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


def _passes(ours_vs_ref: float, ours_vs_fp32: float, ref_vs_fp32: float, limit: float = 0.01) -> bool:
    """Within `limit` of diffusers in the same dtype, or no further from the fp32 reference than
    diffusers' own bf16 run is (bf16 rounding is then the whole difference)."""
    return ours_vs_ref <= limit or ours_vs_fp32 <= 1.25 * ref_vs_fp32 + 1e-3


@stage("correctness", estimate_s=40, limit_s=90, check=True)
def correctness(ctx: Context) -> None:
    """The real-width slice loaded from hub-style shards, then ours vs diffusers in the run's dtype:
    DiT output, VAE decode, the timestep trajectory."""
    from ditfleet.model.loader import load_pipeline

    t0 = time.perf_counter()
    root = write_slice(ctx, ctx.out / "work" / "slice")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe = load_pipeline(
        root, device=ctx.device, dtype=ctx.dtype, load_text_encoder_too=False, model_id="selftest-slice"
    )
    sync(ctx.device)
    load_s = time.perf_counter() - t0
    ctx.state["slice_pipe"] = pipe
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
    ours = pipe.transformer
    x, txt, shapes = dit_inputs(ours.config, size, text_len, 1, ctx.device, ctx.dtype)
    t = torch.full((1,), 0.7, device=ctx.device, dtype=ctx.dtype)
    with torch.no_grad():
        got = ours(x, txt, None, t, shapes)
        ref = _diffusers_transformer(ours, ctx.dtype)
        want = _diffusers_forward(ref, x, txt, t, shapes)
        del ref
        ref32 = _diffusers_transformer(ours, torch.float32)
        exact = _diffusers_forward(ref32, x.float(), txt.float(), t.float(), shapes)
        del ref32
    errs = (rel_err(got, want), rel_err(got, exact), rel_err(want, exact))
    ctx.emit(
        {
            "status": "pass" if _passes(*errs) else "fail",
            "check": "dit_vs_diffusers",
            "diffusers": version,
            "size": size,
            "text_len": text_len,
            "rel_err": round(errs[0], 5),
            "rel_err_vs_fp32": round(errs[1], 5),
            "diffusers_rel_err_vs_fp32": round(errs[2], 5),
            "limit": 0.01,
        }
    )
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
    with torch.no_grad():
        got = pipe.vae.decode(z)
        for dtype in (ctx.dtype, torch.float32):
            ref = (
                AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype).to(ctx.device).eval()
            )
            results[dtype] = ref.decode(z.to(dtype)[:, :, None]).sample[:, :, 0]
            del ref
    errs = (
        rel_err(got, results[ctx.dtype]),
        rel_err(got, results[torch.float32]),
        rel_err(results[ctx.dtype], results[torch.float32]),
    )
    ctx.emit(
        {
            "status": "pass" if _passes(*errs) else "fail",
            "check": "vae_vs_diffusers",
            "diffusers": version,
            "size": size,
            "rel_err": round(errs[0], 5),
            "rel_err_vs_fp32": round(errs[1], 5),
            "diffusers_rel_err_vs_fp32": round(errs[2], 5),
            "limit": 0.01,
        }
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


class SdpaRecorder:
    """Wraps F.scaled_dot_product_attention: per call, the caller (DiT or VAE), the shapes and
    strides it got, and the backend SDPA's own dispatcher picks for them (`torch._fused_sdp_choice`,
    under the preference in force). With `fused_only` on CUDA the math path is disabled, so a call
    no fused kernel takes raises: it is recorded as such, then run on the math path."""

    def __init__(self, fused_only: bool) -> None:
        self.fused_only = fused_only
        self.calls: list[dict[str, Any]] = []

    @contextmanager
    def active(self):
        original = F.scaled_dot_product_attention

        def recorded(q, k, v, attn_mask=None, *args, **kwargs):
            caller = inspect.stack(context=0)[1].filename
            site = (
                "vae"
                if "vae" in Path(caller).name
                else "dit"
                if "attention" in Path(caller).name
                else Path(caller).name
            )
            call = {
                "site": site,
                "q": list(q.shape),
                "kv_len": k.shape[-2],
                "strides": [list(t.stride()) for t in (q, k, v)],
                "last_dim_contiguous": all(t.stride(-1) == 1 for t in (q, k, v)),
                "mask": attn_mask is not None,
                "backend": sdpa_choice(q, k, v, attn_mask),
            }
            try:
                out = original(q, k, v, attn_mask, *args, **kwargs)
            except RuntimeError as e:
                call["backend"] = "none"
                call["error"] = str(e).splitlines()[0][:200]
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.MATH]):
                    out = original(q, k, v, attn_mask, *args, **kwargs)
            self.calls.append(call)
            return out

        F.scaled_dot_product_attention = recorded
        try:
            if self.fused_only:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                fused = [
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION,
                ]
                with sdpa_kernel(fused):
                    yield self
            else:
                yield self
        finally:
            F.scaled_dot_product_attention = original


def summarize_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for c in calls:
        key = json.dumps([c["site"], c["q"], c["kv_len"], c["mask"], c["backend"], c["last_dim_contiguous"]])
        if key not in groups:
            groups[key] = {k: c[k] for k in ("site", "q", "kv_len", "mask", "backend", "last_dim_contiguous")}
            groups[key]["calls"] = 0
            if "error" in c:
                groups[key]["error"] = c["error"]
        groups[key]["calls"] += 1
    return list(groups.values())


@stage("sdpa_backends", estimate_s=10, limit_s=60, check=True)
def sdpa_backends(ctx: Context) -> None:
    """Every SDPA call of one CFG step (a padded batch of 2) and one VAE decode: the backend of
    each; zero calls may take the math path."""
    pipe = ctx.state.get("slice_pipe")
    if pipe is None:
        raise StageSkipped("needs the slice of the correctness stage")
    size = 64 if ctx.tiny else 512
    cfg = pipe.transformer.config
    g = torch.Generator().manual_seed(5)
    long, short = (8, 5) if ctx.tiny else (64, 40)
    embeds = torch.randn(2, long, cfg.joint_attention_dim, generator=g)
    mask = torch.ones(2, long, dtype=torch.long)
    mask[1, short:] = 0
    neg = torch.randn(1, 3, cfg.joint_attention_dim, generator=g).expand(2, -1, -1)
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


# -- 4. compile --------------------------------------------------------------------------------------


def compile_config(ctx: Context, dit: bool, vae: bool) -> CompileConfig:
    backend = ctx.args.compile_backend or ("eager" if ctx.tiny else "inductor")
    return CompileConfig(
        vae=vae,
        dit=dit,
        shared_cache=False,
        dit_mode=ctx.args.compile_mode,
        dit_backend=backend,
        vae_backend=backend,
        cpu_onednn_linear=False,
    )


def length_sweep(tiny: bool) -> list[int]:
    """Prompt lengths 1..512 at every power-of-two edge (where a size guard would split)."""
    if tiny:
        return [1, 2, 3, 8, 16]
    top = 512
    lengths = {1, 2, 3, top}
    p = 4
    while p <= top:
        lengths |= {p - 1, p, min(p + 1, top)}
        p *= 2
    return sorted(lengths)


@stage("compile", estimate_s=120, limit_s=200, check=True)
def compile_stage(ctx: Context) -> None:
    """The slice's DiT blocks and VAE decode compiled as the worker compiles them, at the main
    bucket: no fallback to eager, and zero recompiles over batch 1..4 and prompt lengths 1..512."""
    pipe = ctx.state.get("slice_pipe")
    if pipe is None:
        raise StageSkipped("needs the slice of the correctness stage")
    size = sizes(ctx)[0]
    # Tracing the whole VAE decode costs half a minute of CPU even with the eager backend: the
    # smoke run leaves it to the compile tests and compiles the DiT regions only.
    config = compile_config(ctx, dit=True, vae=not ctx.tiny)
    report = apply_compile(pipe, config)
    dit = pipe.transformer
    cfg = dit.config
    g = torch.Generator().manual_seed(7)
    h, w = latent_grid(size, size)
    shapes = lambda b: [[(1, h, w)]] * b  # noqa: E731
    x4 = torch.randn(4, h * w, 64, generator=g).to(ctx.device, ctx.dtype)
    t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)

    def text(b: int, length: int) -> torch.Tensor:
        return torch.randn(b, length, cfg.joint_attention_dim, generator=g).to(ctx.device, ctx.dtype)

    t0 = time.perf_counter()
    with torch.no_grad():
        # The worker's warm-up: one batch of the configured size (4) and a mid-length prompt.
        dit(x4, text(4, 64 if not ctx.tiny else 8), None, t, shapes(4))
        z = torch.randn(1, 16, size // 8, size // 8, generator=g).to(ctx.device, ctx.dtype)
        pipe.vae.decode(z)
        sync(ctx.device)
    warm_s = time.perf_counter() - t0
    ctx.emit(
        {
            "status": "fail" if report.fallbacks else "measured",
            "check": "compile_warmup",
            "size": size,
            "settings": report.config.describe(ctx.device.type),
            "warmup_s": round(warm_s, 1),
            "compiles": compile_count(),
            "fallbacks": report.fallbacks,
        }
    )
    before = compile_count()
    recompiled: list[list[int]] = []
    lengths = length_sweep(ctx.tiny)
    with torch.no_grad():
        for b in (1, 2, 3, 4):
            for length in lengths:
                ctx.check(f"recompile sweep at batch {b}, length {length}")
                n = compile_count()
                embeds = text(b, length)
                mask = None
                if b > 1 and length > 1:  # a padded batch: the split attention path
                    mask = torch.ones(b, length, dtype=torch.long, device=ctx.device)
                    mask[-1, length // 2 :] = 0
                dit(x4[:b], embeds, mask, t, shapes(b))
                if compile_count() != n:
                    recompiled.append([b, length])
            n = compile_count()
            pipe.vae.decode(z.expand(b, -1, -1, -1).contiguous())
            if compile_count() != n:
                recompiled.append([b, "vae"])
        sync(ctx.device)
    status = report.status
    ok = not report.fallbacks and not recompiled and all(s == "compiled" for s in status.values())
    ctx.emit(
        {
            "status": "pass" if ok else "fail",
            "check": "recompiles",
            "batches": [1, 2, 3, 4],
            "prompt_lengths": f"{len(lengths)} lengths {lengths[0]}..{lengths[-1]} (every power-of-two edge)",
            "recompiles": compile_count() - before,
            "recompiled_at": recompiled[:20],
            "fallbacks": report.fallbacks,
            "not_compiled": sorted({k.split(".")[-1] for k, s in status.items() if s != "compiled"}),
            "limit_hits": report.limit_hits,
        }
    )
    # The compiled VAE stays for the decode lines; the slice's DiT goes (the full model is next).
    ctx.state["vae"] = pipe.vae
    ctx.state["scheduler"] = pipe.scheduler
    free(ctx, "slice_pipe")


# -- 5. speed at full depth ---------------------------------------------------------------------------


def full_model(ctx: Context) -> QwenImageTransformer:
    model = ctx.state.get("dit60")
    if model is None:
        cfg = transformer_config(ctx, ctx.args.layers)
        t0 = time.perf_counter()
        model = make_transformer(cfg, ctx.device, ctx.dtype)
        sync(ctx.device)
        ctx.state["dit60"] = model
        ctx.state["dit60_make_s"] = round(time.perf_counter() - t0, 1)
    return model


def _pct(ctx: Context, flops: float, ms: float) -> float | None:
    ceiling = ctx.state.get("ceiling_tflops")
    if not ceiling or ms <= 0:
        return None
    return round(100 * flops / (ms / 1000) / (ceiling * 1e12), 1)


@stage("dit_eager", estimate_s=25, limit_s=60)
def dit_eager(ctx: Context) -> None:
    """ms per DiT forward at full depth, eager, at each size; % of the measured matmul ceiling;
    peak memory next to the memory plan's."""
    model = full_model(ctx)
    cfg = model.config
    text_len = ctx.args.text_len
    weights = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    for size in sizes(ctx):
        ctx.check(f"eager {size}")
        x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
        t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
        with torch.no_grad():
            ms = timed_ms(
                ctx,
                lambda x=x, txt=txt, t=t, shapes=shapes: model(x, txt, None, t, shapes),
                repeat=ctx.args.repeat,
            )
        N = x.shape[1]
        flops = forward_flops(cfg, 1, N, text_len)
        line: dict[str, Any] = {
            "status": "measured",
            "size": f"{size}x{size}",
            "blocks": cfg.num_layers,
            "text_len": text_len,
            "ms_per_forward": ms,
            "tflop_per_forward": round(flops / 1e12, 2),
            "pct_of_matmul_ceiling": _pct(ctx, flops, ms),
            "make_weights_s": ctx.state.get("dit60_make_s"),
        }
        line.update(_memory_vs_plan(ctx, cfg, size, text_len, base if ctx.cuda else 0, weights))
        ctx.state.setdefault("eager_ms", {})[size] = ms
        ctx.emit(line)


def _memory_vs_plan(
    ctx: Context, cfg: TransformerConfig, size: int, text_len: int, base: int, weights: int
) -> dict[str, Any]:
    model = ModelMemory(cfg, vae_config(ctx), None, "selftest")
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[ctx.dtype]
    plan = plan_memory(
        model,
        height=size,
        width=size,
        batch=1,
        dtype=dtype,
        text_encoder="cpu",
        text_len=text_len,
        device=ctx.device.type,
    )
    out: dict[str, Any] = {
        "plan_denoise_gb": round(plan.phases["denoise"] / GB, 2),
        "plan_dit_activations_gb": round(plan.activations["denoise"] / GB, 3),
    }
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device)
        out.update(
            peak_allocated_gb=round(peak / GB, 2),
            peak_reserved_gb=round(torch.cuda.max_memory_reserved(ctx.device) / GB, 2),
            dit_weights_gb=round(weights / GB, 2),
            measured_dit_activations_gb=round((peak - base) / GB, 3),
        )
    return out


@stage("dit_compiled", estimate_s=60, limit_s=150)
def dit_compiled(ctx: Context) -> None:
    """ms per DiT forward at full depth, compiled as the worker compiles it (the main bucket;
    the slice's compile filled the caches), and the compile fallbacks (must be none)."""
    model = full_model(ctx)
    pipe = TextToImagePipeline(
        model,
        ctx.state.get("vae") or make_vae(vae_config(ctx), ctx.device, ctx.dtype, False),
        ctx.state.get("scheduler"),
    )
    report = apply_compile(pipe, compile_config(ctx, dit=True, vae=False))
    ctx.state["compiled_report"] = report
    cfg, text_len = model.config, ctx.args.text_len
    for size in sizes(ctx):
        ctx.check(f"compiled {size}")
        x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
        t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
        t0 = time.perf_counter()
        before = compile_count()
        with torch.no_grad():
            model(x, txt, None, t, shapes)
            sync(ctx.device)
            first_s = time.perf_counter() - t0
            ms = timed_ms(
                ctx,
                lambda x=x, txt=txt, t=t, shapes=shapes: model(x, txt, None, t, shapes),
                repeat=ctx.args.repeat,
                warm=0,
            )
        flops = forward_flops(cfg, 1, x.shape[1], text_len)
        eager = ctx.state.get("eager_ms", {}).get(size)
        ctx.state.setdefault("compiled_ms", {})[size] = ms
        ctx.emit(
            {
                "status": "fail" if report.fallbacks else "measured",
                "size": f"{size}x{size}",
                "blocks": cfg.num_layers,
                "settings": report.config.describe(ctx.device.type),
                "ms_per_forward": ms,
                "pct_of_matmul_ceiling": _pct(ctx, flops, ms),
                "speedup_vs_eager": round(eager / ms, 3) if eager else None,
                "first_call_s": round(first_s, 1),
                "compiles": compile_count() - before,
                "fallbacks": report.fallbacks,
            }
        )


@stage("cfg_step", estimate_s=15, limit_s=45)
def cfg_step(ctx: Context) -> None:
    """ms per CFG step (conditional + a 4-token negative, the Euler step) per modulation-cache mode."""
    model = full_model(ctx)
    size, text_len = sizes(ctx)[0], ctx.args.text_len
    cfg = model.config
    x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
    neg = torch.randn(1, 4, cfg.joint_attention_dim).to(ctx.device, ctx.dtype)
    step_t = torch.full((1,), 0.25, device=ctx.device, dtype=ctx.dtype)
    sig = torch.tensor([0.25, 0.2], device=ctx.device)

    def step() -> torch.Tensor:
        c = model(x, txt, None, step_t, shapes)
        u = model(x, neg, None, step_t, shapes)
        return euler_step(x, true_cfg(c, u, 4.0), sig[0], sig[1])

    out: dict[str, float] = {}
    with torch.no_grad():
        for mode in ("off", "cfg", "table"):
            ctx.check(f"mode {mode}")
            model.modulation_cache.set_mode(mode)
            if mode == "table":
                model(x, txt, None, step_t, shapes)  # fill the table for this step
            out[mode] = timed_ms(ctx, step, repeat=ctx.args.repeat)
        model.modulation_cache.set_mode("cfg")
    ctx.state["cfg_step_ms"] = out
    compiled = "compiled_report" in ctx.state and not ctx.state["compiled_report"].fallbacks
    ctx.emit(
        {
            "status": "measured",
            "size": f"{size}x{size}",
            "dit": "compiled" if compiled else "eager",
            "ms_per_cfg_step": out,
            "speedup_cfg_vs_off": round(out["off"] / out["cfg"], 3),
            "speedup_table_vs_off": round(out["off"] / out["table"], 3),
        }
    )


@stage("vae_decode", estimate_s=30, limit_s=90)
def vae_decode(ctx: Context) -> None:
    """ms per VAE decode, eager vs compiled (the compile stage's), at the main bucket; its peak
    memory next to the plan's."""
    vae = ctx.state.get("vae")
    if vae is None:
        raise StageSkipped("needs the compiled VAE of the compile stage")
    size = sizes(ctx)[0]
    z = torch.randn(1, 16, size // 8, size // 8).to(ctx.device, ctx.dtype)
    eager_decode = type(vae).decode.__get__(vae)
    line: dict[str, Any] = {"status": "measured", "size": f"{size}x{size}"}
    with torch.no_grad():
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
        line["eager_ms"] = timed_ms(ctx, lambda: eager_decode(z), repeat=ctx.args.repeat)
        if ctx.cuda:
            line["measured_activations_gb"] = round(
                (torch.cuda.max_memory_allocated(ctx.device) - base) / GB, 3
            )
        ctx.check("compiled decode")
        line["compiled_ms"] = timed_ms(ctx, lambda: vae.decode(z), repeat=ctx.args.repeat)
    from ditfleet.model.memory import vae_decode_activation_bytes

    e = torch.finfo(ctx.dtype).bits // 8
    line["plan_activations_gb"] = round(
        vae_decode_activation_bytes(vae_config(ctx), 1, size, size, e) / GB, 3
    )
    line["speedup"] = round(line["eager_ms"] / line["compiled_ms"], 3)
    ctx.state["decode_ms"] = min(line["eager_ms"], line["compiled_ms"])
    ctx.emit(line)


@stage("images_per_hour", estimate_s=1, limit_s=10)
def images_per_hour(ctx: Context) -> None:
    """Images per hour at 50 steps, batch 1: 50 CFG steps (modulation cache 'cfg') + one decode."""
    step = ctx.state.get("cfg_step_ms", {}).get("cfg")
    decode = ctx.state.get("decode_ms")
    if step is None or decode is None:
        raise StageSkipped("needs the cfg_step and vae_decode lines")
    per_image = 50 * step + decode
    ctx.emit(
        {
            "status": "measured",
            "size": f"{sizes(ctx)[0]}x{sizes(ctx)[0]}",
            "steps": 50,
            "ms_per_image": round(per_image, 1),
            "images_per_hour": round(3_600_000 / per_image, 1),
        }
    )


# -- 6. the worker's path -----------------------------------------------------------------------------


class RandomTextEncoder:
    """Stands in for Qwen2.5-VL (not on the node): each prompt's embeddings drawn from its own
    hash, one token per word, on the CPU, as the placed encoder returns them."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size

    def count_tokens(self, prompts: list[str], max_length: int) -> list[int]:
        return [min(max(1, len(p.split())), max_length) for p in prompts]

    def encode(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.count_tokens(list(prompts), max_length)
        embeds = torch.zeros(len(prompts), max(lengths), self.hidden_size)
        mask = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little")
            embeds[i, :n] = torch.randn(n, self.hidden_size, generator=torch.Generator().manual_seed(seed))
            mask[i, :n] = 1
        return embeds, mask


@contextmanager
def count_host_syncs(ctx: Context):
    """Blocking device syncs while the block runs: CUDA's sync debug mode warns once per sync."""
    found = {"syncs": None}
    if not ctx.cuda:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found["syncs"] = sum(1 for w in caught if "synchroniz" in str(w.message).lower())


@stage("batch_generator", estimate_s=45, limit_s=90)
def batch_generator(ctx: Context) -> None:
    """The worker's BatchGenerator (the code a job runs, minus Ray) on one small shard at the main
    bucket, images stored by the files writer on local disk; compared with the bare CFG step."""
    from ditfleet.model.settings import PipelineSettings
    from ditfleet.workers.generate import BatchGenerator, image_requests, iter_generated, plan_batches
    from ditfleet.workers.output.formats import ImageTask, ShardWriterConfig, make_shard_writer
    from ditfleet.workers.output.layout import new_attempt_token
    from ditfleet.workers.rows import PromptRow
    from ditfleet.workers.storage.local import LocalStore

    model = full_model(ctx)
    vae = ctx.state.get("vae") or make_vae(vae_config(ctx), ctx.device, ctx.dtype, False)
    scheduler = ctx.state.get("scheduler")
    if scheduler is None:
        raise StageSkipped("needs the scheduler of the correctness stage")
    encoder = RandomTextEncoder(model.config.joint_attention_dim)
    pipe = TextToImagePipeline(
        model, vae, scheduler, encoder, model_id="selftest", settings=PipelineSettings()
    )
    size, steps, images = sizes(ctx)[0], ctx.args.worker_steps, ctx.args.worker_images
    rows = [
        PromptRow(
            id=f"p{i}",
            prompt=" ".join(["word"] * (20 + 3 * i)),
            negative_prompt=None,
            seed=i,
            width=size,
            height=size,
            requested_width=None,
            requested_height=None,
            bucket=f"{size}x{size}",
            steps=steps,
            true_cfg_scale=4.0,
            num_images=1,
            file="selftest",
            row=i,
        )  # fmt: skip
        for i in range(images)
    ]
    generator = BatchGenerator(pipe)
    requests = image_requests(rows)
    batches = plan_batches(requests, ctx.args.worker_batch, generator.count_tokens)
    store = LocalStore(str(ctx.out / "work" / "shard"))
    writer = make_shard_writer(store, 0, ShardWriterConfig(), new_attempt_token(0))
    t0 = time.perf_counter()
    with count_host_syncs(ctx) as syncs:
        generate_s = 0.0
        for image in iter_generated(generator, batches):
            ctx.check("batch generator")
            generate_s += image.generate_s
            req = image.request
            writer.add(
                ImageTask(req.row.id, req.k, 1, req.row.prompt, None, req.seed),
                image.pixels.permute(1, 2, 0).numpy(),
            )
    stored = writer.finish()
    wall = time.perf_counter() - t0
    step = ctx.state.get("cfg_step_ms", {}).get("cfg")
    decode = ctx.state.get("decode_ms")
    per_image_ms = 1000 * generate_s / images
    line: dict[str, Any] = {
        "status": "measured",
        "size": f"{size}x{size}",
        "images": images,
        "batches": len(batches),
        "steps": steps,
        "shard_wall_s": round(wall, 2),
        "ms_per_image": round(per_image_ms, 1),
        "stored": len(stored.results),
        "host_syncs": syncs["syncs"],
    }
    if step and decode:
        bare = batches and (steps * step * len(batches[0]) + decode * len(batches[0])) / len(batches[0])
        line["bare_ms_per_image"] = round(bare, 1)
        line["overhead_vs_bare"] = round(per_image_ms / bare, 3)
        # 50 steps through the worker: its per-step cost scaled, the decode once.
        per_step = max(per_image_ms - decode, 1e-3) / steps
        line["images_per_hour_50_steps"] = round(3_600_000 / (50 * per_step + decode), 1)
    ctx.emit(line)


# -- 7. slots for lines other work adds ---------------------------------------------------------------


def _slot_function(module: str, name: str) -> Callable[..., Any] | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


@stage("fp8_forward", estimate_s=40, limit_s=90)
def fp8_forward(ctx: Context) -> None:
    """The slot of the FP8 line: `ditfleet.model.fp8.selftest_forward(transformer, mode)` (or in
    `model.quantization`) returns an FP8 DiT over the full-depth model's weights (mode 'fp8' or
    'fp8-weight-only'), or None when this GPU cannot run the mode; this stage times it like the
    eager line and reports its error against the bf16 output."""
    fn = _slot_function("ditfleet.model.fp8", "selftest_forward") or _slot_function(
        "ditfleet.model.quantization", "selftest_forward"
    )
    if fn is None:
        raise StageSkipped("slot: no model.fp8.selftest_forward yet")
    model = full_model(ctx)
    cfg, size, text_len = model.config, sizes(ctx)[0], ctx.args.text_len
    x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
    t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
    with torch.no_grad():
        bf16_peak = _forward_peak_gb(ctx, lambda: model(x, txt, None, t, shapes))
        exact = model(x, txt, None, t, shapes)
        for mode in ("fp8", "fp8-weight-only"):
            ctx.check(mode)
            fp8 = fn(model, mode)
            if fp8 is None:
                ctx.emit({"status": "skipped", "mode": mode, "reason": "not supported here"})
                continue
            ms = timed_ms(ctx, lambda fp8=fp8: fp8(x, txt, None, t, shapes), repeat=ctx.args.repeat)
            eager = ctx.state.get("eager_ms", {}).get(size)
            peak = _forward_peak_gb(ctx, lambda fp8=fp8: fp8(x, txt, None, t, shapes))
            got = fp8(x, txt, None, t, shapes)
            weights = sum(p.numel() * p.element_size() for p in (*fp8.parameters(), *fp8.buffers()))
            ctx.emit(
                {
                    "status": "measured",
                    "mode": mode,
                    "size": f"{size}x{size}",
                    "ms_per_forward": ms,
                    "speedup_vs_bf16_eager": round(eager / ms, 3) if eager else None,
                    "rel_err_vs_bf16": round(rel_err(got, exact), 4),
                    "weights_gb": round(weights / 1e9, 2),
                    # Above the weights resident before the call (the bf16 DiT stays loaded too).
                    "forward_peak_gb": peak,
                    "bf16_forward_peak_gb": bf16_peak,
                }
            )
            del fp8


def _forward_peak_gb(ctx: Context, fn: Callable[[], object]) -> float | None:
    """GB one call of `fn` allocates at its peak above what was allocated before; None off CUDA."""
    if not ctx.cuda:
        return None
    sync(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    fn()
    sync(ctx.device)
    return round((torch.cuda.max_memory_allocated(ctx.device) - base) / 1e9, 2)


@stage("step_cache", estimate_s=40, limit_s=90)
def step_cache(ctx: Context) -> None:
    """The slot of the step-cache line: `ditfleet.model.step_cache.selftest_line(pipe, size, steps)`
    returns a dict (DiT work and wall-time speed-up of a preset against exact) to print."""
    fn = _slot_function("ditfleet.model.step_cache", "selftest_line")
    if fn is None:
        raise StageSkipped("slot: no model.step_cache.selftest_line yet")
    model = full_model(ctx)
    pipe = TextToImagePipeline(model, ctx.state["vae"], ctx.state["scheduler"])
    ctx.emit({"status": "measured", **fn(pipe, sizes(ctx)[0], 20)})


# -- 8. the other sizes, last: each compiles its own graphs ---------------------------------------------


@stage("dit_compiled_other_sizes", estimate_s=90, limit_s=150)
def dit_compiled_other_sizes(ctx: Context) -> None:
    """The compiled full-depth forward at the other sizes (a fresh compile each)."""
    if "compiled_report" not in ctx.state:
        raise StageSkipped("needs the dit_compiled stage")
    model = full_model(ctx)
    cfg, text_len = model.config, ctx.args.text_len
    for size in sizes(ctx)[1:]:
        ctx.check(f"compiled {size}")
        x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
        t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x, txt, None, t, shapes)
            sync(ctx.device)
            first_s = time.perf_counter() - t0
            ms = timed_ms(
                ctx,
                lambda x=x, txt=txt, t=t, shapes=shapes: model(x, txt, None, t, shapes),
                repeat=ctx.args.repeat,
                warm=0,
            )
        flops = forward_flops(cfg, 1, x.shape[1], text_len)
        eager = ctx.state.get("eager_ms", {}).get(size)
        report = ctx.state["compiled_report"]
        ctx.emit(
            {
                "status": "fail" if report.fallbacks else "measured",
                "size": f"{size}x{size}",
                "ms_per_forward": ms,
                "pct_of_matmul_ceiling": _pct(ctx, flops, ms),
                "speedup_vs_eager": round(eager / ms, 3) if eager else None,
                "first_call_s": round(first_s, 1),
                "fallbacks": report.fallbacks,
            }
        )


__all__ = ["BACKEND_NAMES"]
