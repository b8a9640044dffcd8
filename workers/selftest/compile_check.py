"""The self-test's compile stage: the slice compiled as the worker compiles it (no fallback to
eager, zero recompiles), and the compile settings the speed lines share with it."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from ditfleet.compile.config import CompileConfig
from ditfleet.compile.counting import compile_count
from ditfleet.compile.policy import CompileReport, apply_compile
from ditfleet.model.generation.sampling import latent_grid
from ditfleet.workers.selftest.checks import slice_pipe
from ditfleet.workers.selftest.parts import FAMILY, free, sizes, sync
from ditfleet.workers.selftest.runner import Context, stage

BATCHES = (1, 2, 3, 4)


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


def stage_compile_config(ctx: Context) -> CompileConfig:
    """What the compile stage compiles: the DiT regions and (on a GPU) the VAE decode. Tracing
    the whole VAE decode costs half a minute of CPU even with the eager backend: the smoke run
    leaves it to the compile tests and compiles the DiT regions only."""
    return compile_config(ctx, dit=True, vae=not ctx.tiny)


def _adopt_compile(ctx: Context, lines: list[dict[str, Any]]) -> None:
    """After the compile stage (run in its child): this process's slice VAE gets the same
    compiled decode, which loads the child's kernels from the Inductor cache at its first call;
    the VAE and the scheduler stay for the decode lines, the slice's DiT goes."""
    pipe = ctx.state.get("slice_pipe")
    if pipe is None:
        return
    config = stage_compile_config(ctx)
    apply_compile(pipe, replace(config, dit=False))
    ctx.state["vae"] = pipe.vae
    ctx.state["scheduler"] = pipe.scheduler
    ctx.state["compile_config"] = config
    ctx.state["compile_passed"] = any(
        line.get("check") == "recompiles" and line.get("status") == "pass" for line in lines
    )
    free(ctx, "slice_pipe")


class CompileInputs:
    """The DiT's and the VAE's inputs at the main bucket for up to 4 images, drawn from one seeded
    generator: the worker's warm-up batch, then the prompts of the recompile sweep."""

    def __init__(self, ctx: Context, text_width: int, size: int) -> None:
        self.ctx, self.text_width = ctx, text_width
        self.g = torch.Generator().manual_seed(7)
        self.h, self.w = latent_grid(size, size)
        self.x4 = self.random(4, self.h * self.w, 64)
        self.t = torch.full((1,), 0.5, device=ctx.device, dtype=ctx.dtype)
        # The worker's warm-up: one batch of the configured size (4) and a mid-length prompt.
        self.warm_text = self.text(4, 64 if not ctx.tiny else 8)
        self.latents = self.random(1, 16, size // 8, size // 8)

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.ctx.device, self.ctx.dtype)

    def text(self, b: int, length: int) -> torch.Tensor:
        return self.random(b, length, self.text_width)

    def shapes(self, b: int) -> list[list[tuple[int, int, int]]]:
        return [[(1, self.h, self.w)]] * b


@stage("compile", estimate_s=90, limit_s=200, check=True, isolated=True, adopt=_adopt_compile)
def compile_stage(ctx: Context) -> None:
    """The slice's DiT blocks and VAE decode compiled as the worker compiles them, at the main
    bucket: no fallback to eager, and zero recompiles over batch 1..4 and prompt lengths 1..512.
    In a child process, so that a compile past the deadline ends with a line."""
    pipe = slice_pipe(ctx)
    size = sizes(ctx)[0]
    report = apply_compile(pipe, stage_compile_config(ctx))
    dit, vae = pipe.transformer, pipe.vae
    inputs = CompileInputs(ctx, FAMILY.text_conditioning(pipe).width, size)
    t0 = time.perf_counter()
    with torch.no_grad():
        dit(inputs.x4, inputs.warm_text, None, inputs.t, inputs.shapes(4))
        vae.decode(inputs.latents)
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
    ctx.emit(_recompile_sweep(ctx, dit, vae, report, inputs))
    # What stays for the later stages is `_adopt_compile`'s (this may be a child process).


def _recompile_sweep(
    ctx: Context, dit: Any, vae: Any, report: CompileReport, inputs: CompileInputs
) -> dict[str, Any]:
    """The `recompiles` line: the compiled DiT over batches 1..4 x the prompt lengths (padded
    batches included) and the VAE decode over batches 1..4, after the warm-up; any compile fails."""
    before = compile_count()
    recompiled: list[list[int | str]] = []
    lengths = length_sweep(ctx.tiny)
    with torch.no_grad():
        for b in BATCHES:
            for length in lengths:
                ctx.check(f"recompile sweep at batch {b}, length {length}")
                n = compile_count()
                embeds = inputs.text(b, length)
                mask = None
                if b > 1 and length > 1:  # a padded batch: the split attention path
                    mask = torch.ones(b, length, dtype=torch.long, device=ctx.device)
                    mask[-1, length // 2 :] = 0
                dit(inputs.x4[:b], embeds, mask, inputs.t, inputs.shapes(b))
                if compile_count() != n:
                    recompiled.append([b, length])
            n = compile_count()
            vae.decode(inputs.latents.expand(b, -1, -1, -1).contiguous())
            if compile_count() != n:
                recompiled.append([b, "vae"])
        sync(ctx.device)
    status = report.status
    ok = not report.fallbacks and not recompiled and all(s == "compiled" for s in status.values())
    return {
        "status": "pass" if ok else "fail",
        "check": "recompiles",
        "batches": list(BATCHES),
        "prompt_lengths": f"{len(lengths)} lengths {lengths[0]}..{lengths[-1]} (every power-of-two edge)",
        "recompiles": compile_count() - before,
        "recompiled_at": recompiled[:20],
        "fallbacks": report.fallbacks,
        "not_compiled": sorted({k.split(".")[-1] for k, s in status.items() if s != "compiled"}),
        "limit_hits": report.limit_hits,
    }
