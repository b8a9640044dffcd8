"""The self-test's speed stages: full-depth DiT forwards eager and compiled, CFG steps, the VAE
decode, images per hour, the step-cache slot, and the compiled forward at the other sizes (last:
each compiles its own graphs). The worker's batch generator (worker_path.py) and the FP8 lines
(fp8_speed.py) slot in between."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ditfleet.compile.compiled_method import CompiledMethod
from ditfleet.compile.counting import compile_count
from ditfleet.compile.policy import CompileReport, apply_compile
from ditfleet.model.cfg_table import CFG_TABLE_FILE, CfgEntry, CfgTable
from ditfleet.model.family_types import DiTConfig
from ditfleet.model.generation.pipeline import Generation, GuidanceInputs, Sampling, TextToImagePipeline
from ditfleet.model.generation.sampling import euler_step, true_cfg
from ditfleet.model.generation.scheduler import SchedulerConfig
from ditfleet.model.memory import GB, Runtime, plan_memory
from ditfleet.model.step_cache_config import PRESETS, StepCacheConfig
from ditfleet.workers.selftest.compile_check import compile_config
from ditfleet.workers.selftest.parts import (
    FAMILY,
    dit_inputs,
    forward_flops,
    make_transformer,
    make_vae,
    plan_model,
    sizes,
    sync,
    timed_ms,
    transformer_config,
)
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage

# -- speed at full depth ------------------------------------------------------------------------------


def full_model(ctx: Context) -> Any:
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


def dit_call(ctx: Context, cfg: DiTConfig, size: int) -> tuple[Callable[[Any], torch.Tensor], int]:
    """One DiT forward of batch 1 at `size` on random inputs, as call(model), and its image tokens.

    Each call passes a timestep tensor of its own, so every forward computes the blocks'
    modulation (MODULATION below): reusing one tensor would make the modulation cache serve every
    other call ('cfg') or all of them ('table'), and the line would time less than a request's
    forward does. The modulation's own share: the cfg_step line, per cache mode."""
    x, txt, shapes = dit_inputs(cfg, size, ctx.args.text_len, 1, ctx.device, ctx.dtype)

    def call(model):
        return model(x, txt, None, torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype), shapes)

    return call, x.shape[1]


# What the DiT lines' "modulation" field says: their forwards include the blocks' modulation.
MODULATION = "computed each forward"


@stage("dit_eager", estimate_s=20, limit_s=60)
def dit_eager(ctx: Context) -> None:
    """ms per DiT forward at full depth, eager, at each size; % of the measured matmul ceiling;
    peak memory next to the memory plan's."""
    model = full_model(ctx)
    cfg = model.config
    text_len = ctx.args.text_len
    weights = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    for size in sizes(ctx):
        ctx.check(f"eager {size}")
        call, N = dit_call(ctx, cfg, size)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
            base = torch.cuda.memory_allocated(ctx.device)
        with torch.no_grad():
            ms = timed_ms(ctx, functools.partial(call, model), repeat=ctx.args.repeat)
        flops = forward_flops(cfg, size, text_len)
        line: dict[str, Any] = {
            "status": "measured",
            "size": f"{size}x{size}",
            "blocks": cfg.num_layers,
            "text_len": text_len,
            "modulation": MODULATION,
            "ms_per_forward": ms,
            "tflop_per_forward": round(flops / 1e12, 2),
            "pct_of_matmul_ceiling": _pct(ctx, flops, ms),
            "make_weights_s": ctx.state.get("dit60_make_s"),
        }
        line.update(_memory_vs_plan(ctx, cfg, size, text_len, base if ctx.cuda else 0, weights))
        if size == sizes(ctx)[0]:
            line["projections"] = _fused_against_separate(ctx, model, call, ms)
        ctx.state.setdefault("eager_ms", {})[size] = ms
        ctx.emit(line)


def _fused_against_separate(
    ctx: Context, model: Any, call: Callable[[Any], torch.Tensor], fused_ms: float
) -> dict:
    """Issue 50, lever 5 on this GPU: the eager forward with the image's q/k/v as three GEMMs
    against the fused GEMM the loader sets up (`fused_ms`, just timed), and whether the outputs
    are the same bits. The DiT is fused again after."""
    ctx.check("projections unfused")
    with torch.no_grad():
        fused_out = call(model)
        FAMILY.fuse_projections(model, on=False)
        try:
            separate_ms = timed_ms(ctx, functools.partial(call, model), repeat=ctx.args.repeat)
            same = bool(torch.equal(fused_out, call(model)))
        finally:
            FAMILY.fuse_projections(model)
    return {
        "fused_ms": fused_ms,
        "three_gemms_ms": separate_ms,
        "fused_speedup": round(separate_ms / fused_ms, 3),
        "bit_identical": same,
    }


def _memory_vs_plan(
    ctx: Context, cfg: DiTConfig, size: int, text_len: int, base: int, weights: int
) -> dict[str, Any]:
    model = plan_model(ctx, cfg)
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[ctx.dtype]
    run = Runtime(dtype=dtype, text_encoder="cpu", text_len=text_len, device=ctx.device.type)
    plan = plan_memory(model, height=size, width=size, batch=1, run=run)
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


@stage("dit_compiled", estimate_s=25, limit_s=120)
def dit_compiled(ctx: Context) -> None:
    """ms per DiT forward at full depth at the main bucket, compiled as the worker compiles it
    (its graphs load from the cache the compile stage filled), and the compile fallbacks (must
    be none). The other sizes compile last, each in its own child process."""
    if ctx.state.get("compile_passed") is False:
        raise StageSkipped(
            "the compile stage did not finish: a fresh compile of the full model here could not be "
            "stopped at this stage's deadline"
        )
    model = full_model(ctx)
    vae = ctx.state.get("vae") or make_vae(ctx)
    pipe = pipeline_to_compile(model, vae)
    # The compile stage's settings with the DiT on: its compiled VAE decode stays installed
    # (apply_compile keeps a target compiled with the same settings, and would uninstall it
    # under a config with the VAE off).
    config = replace(ctx.state.get("compile_config") or compile_config(ctx, dit=True, vae=False), dit=True)
    report = apply_compile(pipe, config)
    ctx.state["compiled_report"] = report
    before = compile_count()
    ctx.emit(compiled_forward_line(ctx, model, sizes(ctx)[0], report, compiles_before=before))


@stage("cfg_step", estimate_s=15, limit_s=45)
def cfg_step(ctx: Context) -> None:
    """ms per CFG step (conditional + a 4-token negative, the Euler step) per modulation-cache mode."""
    model = full_model(ctx)
    size, text_len = sizes(ctx)[0], ctx.args.text_len
    cfg = model.config
    x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
    neg = torch.randn(1, 4, FAMILY.text_width(cfg.to_dict())).to(ctx.device, ctx.dtype)
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


# Beyond the budget's plan: run with --extra cfg_modes.
@stage("cfg_modes", estimate_s=25, limit_s=90, after="cfg_step", optional=True)
def cfg_modes(ctx: Context) -> None:
    """What issue 50's levers 2 and 3 are decided on, at each size: ms per step without CFG per
    modulation-cache mode (a few-step checkpoint's step: one forward, the Euler step), and ms per
    CFG step serial (two forwards of the batch) against batched (one forward of twice the batch,
    the 4-token negative padded to the prompt's length) at batch 1 and 4, under the GPU's default
    cache ('table'). Optional (`--extra cfg_modes`): it does not fit the budget's plan.

    The serial-against-batched times go to `cfg_table.json` in --out too, rewritten after each
    size (a deadline keeps the sizes measured): the table a job's `sampling.cfg_table` names, so
    that `cfg_mode: auto` picks by it (model.cfg_table)."""
    model = full_model(ctx)
    cfg, text_len = model.config, ctx.args.text_len
    sig = torch.tensor([0.25, 0.2], device=ctx.device)
    step_t = torch.full((1,), 0.25, device=ctx.device, dtype=ctx.dtype)
    device = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    entries: list[CfgEntry] = []
    for size in sizes(ctx):
        x, txt, shapes = dit_inputs(cfg, size, text_len, 1, ctx.device, ctx.dtype)
        no_cfg: dict[str, float] = {}
        with torch.no_grad():
            for mode in ("off", "cfg", "table"):
                ctx.check(f"{size} no cfg {mode}")
                model.modulation_cache.set_mode(mode)

                def step(mode: str = mode, x=x, txt=txt, shapes=shapes) -> torch.Tensor:
                    # a schedule passes one tensor per step: the table's key; 'cfg' sees a new
                    # step every call, as a job without CFG does
                    t = step_t if mode == "table" else torch.full_like(step_t, 0.25)
                    return euler_step(x, model(x, txt, None, t, shapes), sig[0], sig[1])

                step()  # a table's entry for this step, as the warm-up builds it
                no_cfg[mode] = timed_ms(ctx, step, repeat=ctx.args.repeat)
            model.modulation_cache.set_mode("table")
            by_batch = {}
            for batch in (1, 4):
                ctx.check(f"{size} batch {batch} serial vs batched")
                by_batch[str(batch)] = _serial_vs_batched(ctx, model, size, batch, step_t, sig)
            model.modulation_cache.set_mode("cfg")
        entries += [CfgEntry(size, size, int(b), m["serial"], m["batched"]) for b, m in by_batch.items()]
        table = write_cfg_table(ctx.out / CFG_TABLE_FILE, CfgTable(device, tuple(entries)))
        ctx.emit(
            {
                "status": "measured",
                "size": f"{size}x{size}",
                "modulation": "per mode (table: built before timing)",
                "ms_per_step_without_cfg": no_cfg,
                "speedup_table_vs_cfg_without_cfg": round(no_cfg["cfg"] / no_cfg["table"], 3),
                "cfg_serial_vs_batched_ms": by_batch,
                "cfg_table": str(table),
            }
        )


def write_cfg_table(path: Path, table: CfgTable) -> Path:
    """The table as a job's sampling.cfg_table reads it, replaced whole (never half written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(table.to_dict(), indent=1) + "\n")
    tmp.replace(path)
    return path


def _serial_vs_batched(ctx: Context, model, size: int, batch: int, step_t, sig) -> dict:
    """ms per CFG step of `batch` images, serial and batched, and which is faster."""
    cfg, text_len = model.config, ctx.args.text_len
    x, txt, shapes = dit_inputs(cfg, size, text_len, batch, ctx.device, ctx.dtype)
    neg = torch.randn(batch, 4, txt.shape[2]).to(ctx.device, ctx.dtype)  # txt: (B, L, text width)
    both_txt = torch.cat([txt, torch.cat([neg, neg.new_zeros(batch, text_len - 4, neg.shape[2])], 1)])
    mask = torch.ones(2 * batch, text_len, device=ctx.device, dtype=torch.long)
    mask[batch:, 4:] = 0
    both_x = torch.cat([x, x])

    def serial() -> torch.Tensor:
        c, u = model(x, txt, None, step_t, shapes), model(x, neg, None, step_t, shapes)
        return euler_step(x, true_cfg(c, u, 4.0), sig[0], sig[1])

    def batched() -> torch.Tensor:
        c, u = model(both_x, both_txt, mask, step_t, shapes * 2).chunk(2)
        return euler_step(x, true_cfg(c, u, 4.0), sig[0], sig[1])

    serial()
    out = {"serial": timed_ms(ctx, serial, repeat=ctx.args.repeat)}
    batched()
    out["batched"] = timed_ms(ctx, batched, repeat=ctx.args.repeat)
    return {**out, "faster": "batched" if out["batched"] < out["serial"] else "serial"}


@stage("vae_decode", estimate_s=20, limit_s=90)
def vae_decode(ctx: Context) -> None:
    """ms per VAE decode, eager vs compiled (the compile stage's), at the main bucket; its peak
    memory next to the plan's."""
    vae = ctx.state.get("vae")
    if vae is None:
        raise StageSkipped("needs the compiled VAE of the compile stage")
    size = sizes(ctx)[0]
    z = torch.randn(1, 16, size // 8, size // 8).to(ctx.device, ctx.dtype)
    eager_decode = type(vae).decode.__get__(vae)
    compiled = compiled_decode(vae)
    line: dict[str, Any] = {"status": "measured", "size": f"{size}x{size}", "compiled": compiled is not None}
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
    e = torch.finfo(ctx.dtype).bits // 8
    line["plan_activations_gb"] = round(
        plan_model(ctx, transformer_config(ctx, 1)).vae_decode_activation_bytes(1, size, size, e) / GB, 3
    )
    line["speedup"] = round(line["eager_ms"] / line["compiled_ms"], 3)
    if compiled is not None:
        line["compiled_status"] = compiled.status  # "eager" here: its compile fell back
        line["fallback"] = compiled.fallback_reason
    ctx.state["decode_ms"] = min(line["eager_ms"], line["compiled_ms"])
    ctx.emit(line)


def compiled_decode(vae) -> CompiledMethod | None:
    """The compiled `decode` installed on `vae` (compile.policy), or None: it decodes eager."""
    fn = vars(vae).get("decode")
    return fn if isinstance(fn, CompiledMethod) else None


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


# -- step caching -------------------------------------------------------------------------------------


@stage("step_cache", estimate_s=30, limit_s=90)
def step_cache(ctx: Context) -> None:
    """One image on the full-depth model at the first size, exact and with each step-cache
    preset, same seed and prompt embeddings: per preset the DiT work and wall-time speed-ups
    against exact, and how far the final latents moved (relative L2). The weights are random, so
    the distance says nothing of a real model's quality (`ditfleet calibrate` measures that); the
    wall-time speed-up next to the work speed-up shows what the decisions, the batch subsets and
    the kept residuals cost on the device."""
    pipe = TextToImagePipeline(
        full_model(ctx), ctx.state["vae"], ctx.state["scheduler"], prepare_inputs=FAMILY.prepare_inputs
    )
    size, steps, text, width = sizes(ctx)[0], 20, 64, FAMILY.text_conditioning(pipe).width
    g = torch.Generator().manual_seed(3)
    inputs: GuidanceInputs = {
        "prompt_embeds": torch.randn(1, text, width, generator=g),
        "prompt_embeds_mask": None,
        "negative_prompt_embeds": torch.randn(1, text // 2, width, generator=g),
        "negative_prompt_embeds_mask": None,
    }

    def run(config: StepCacheConfig | None, n: int = steps) -> tuple[Generation, torch.Tensor, float]:
        t0 = time.perf_counter()
        out = pipe.with_step_cache(config).run(inputs, Sampling(size, size, n, [0], 4.0), decode=False)
        latents = out.images.float().cpu()  # .cpu() waits
        return out, latents, time.perf_counter() - t0

    run(None, 1)  # one-off costs out of the timings
    _, exact, exact_s = run(None)
    line: dict[str, Any] = {
        "size": f"{size}x{size}",
        "steps": steps,
        "exact_s": round(exact_s, 3),
        "presets": {},
    }
    for name, config in PRESETS.items():
        if config is None:
            continue
        out, latents, seconds = run(config)
        assert out.step_cache is not None
        per = out.step_cache.per_image()[0]
        line["presets"][name] = {
            "active": out.step_cache.inactive is None,
            "work_speedup": round(
                (per["blocks_computed"] + per["blocks_reused"]) / max(1, per["blocks_computed"]), 3
            ),
            "wall_speedup": round(exact_s / seconds, 3),
            "latent_rel_l2": round(float((latents - exact).norm() / exact.norm()), 4),
        }
    ctx.emit({"status": "measured", **line})


# -- the other sizes, last: each compiles its own graphs ----------------------------------------------


@stage("dit_compiled_other_sizes", estimate_s=60, limit_s=150, isolated=True, frees=("dit60",))
def dit_compiled_other_sizes(ctx: Context) -> None:
    """The compiled full-depth forward at the other sizes (a fresh compile each), in a child
    process that has the device to itself: this process drops its full-depth DiT first."""
    model = full_model(ctx)
    report = compile_dit(ctx, model)
    for size in sizes(ctx)[1:]:
        ctx.emit(compiled_forward_line(ctx, model, size, report))


def pipeline_to_compile(model: Any, vae: Any) -> TextToImagePipeline:
    """`model` and `vae` in a pipeline for apply_compile, which compiles its modules and never
    samples: the schedule (the default, Qwen-Image's) is never read."""
    return TextToImagePipeline(model, vae, SchedulerConfig(), prepare_inputs=FAMILY.prepare_inputs)


def compile_dit(ctx: Context, model: Any) -> CompileReport:
    """`model` compiled as the worker compiles the DiT, in a pipeline whose fresh VAE stays eager."""
    vae = make_vae(ctx)
    return apply_compile(pipeline_to_compile(model, vae), compile_config(ctx, dit=True, vae=False))


def _fx_cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hit": int(inductor["fxgraph_cache_hit"]), "miss": int(inductor["fxgraph_cache_miss"])}


def compiled_forward_line(ctx: Context, model, size: int, report, compiles_before: int | None = None) -> dict:
    """One compiled full-depth forward at `size`: its first call (the compile, or a cache load) and
    the steady ms per forward, against the eager figure and the matmul ceiling."""
    ctx.check(f"compiled {size}")
    cfg = model.config
    call, N = dit_call(ctx, cfg, size)
    cache_before = _fx_cache_counts()
    t0 = time.perf_counter()
    with torch.no_grad():
        call(model)
        sync(ctx.device)
        first_s = time.perf_counter() - t0
        cache = {k: v - cache_before.get(k, 0) for k, v in _fx_cache_counts().items()}
        ms = timed_ms(ctx, lambda: call(model), repeat=ctx.args.repeat, warm=0)
    flops = forward_flops(cfg, size, ctx.args.text_len)
    eager = ctx.state.get("eager_ms", {}).get(size)
    ctx.state.setdefault("compiled_ms", {})[size] = ms
    line = {
        "status": "fail" if report.fallbacks else "measured",
        "size": f"{size}x{size}",
        "blocks": cfg.num_layers,
        "modulation": MODULATION,
        "settings": report.config.describe(ctx.device.type),
        "ms_per_forward": ms,
        "pct_of_matmul_ceiling": _pct(ctx, flops, ms),
        "speedup_vs_eager": round(eager / ms, 3) if eager else None,
        "first_call_s": round(first_s, 1),
        # Inductor's FX graph cache during the first call: hits load kernels another process
        # (the compile stage's child) compiled; misses compiled here.
        "fx_graph_cache": cache,
        "fallbacks": report.fallbacks,
    }
    if compiles_before is not None:
        line["compiles"] = compile_count() - compiles_before
    return line
