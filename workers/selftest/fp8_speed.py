"""The self-test's FP8 lines: the full-depth DiT copied as an FP8 DiT of each mode
(parts.fp8_copy), eager next to the bf16 line (`fp8_forward`, the default layer set) and, beyond
the budget's plan, compiled per layer set (`fp8_compiled`: model.loading.quantization.FP8_LAYER_SETS)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ditfleet.compile.counting import compile_count
from ditfleet.model.loading.quantization import FP8_LAYER_SETS
from ditfleet.model.settings import DEFAULT_PIPELINE
from ditfleet.workers.selftest import worker_path  # noqa: F401 - registers batch_generator, which fp8 follows
from ditfleet.workers.selftest.parts import fp8_copy, rel_err, sizes, sync, timed_ms
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage
from ditfleet.workers.selftest.speed import (
    MODULATION,
    compile_dit,
    compiled_forward_line,
    dit_call,
    full_model,
)


@stage("fp8_forward", estimate_s=30, limit_s=90, after="batch_generator")
def fp8_forward(ctx: Context) -> None:
    """The FP8 line: the full-depth DiT copied as an FP8 DiT of each mode ('fp8',
    'fp8-weight-only'; parts.fp8_copy, the default layer set), timed like the eager line, its
    error against the bf16 output; a mode this GPU cannot run is skipped."""
    model = full_model(ctx)
    size = sizes(ctx)[0]
    call, _ = dit_call(ctx, model.config, size)
    with torch.no_grad():
        bf16_peak = _forward_peak_gb(ctx, lambda: call(model))
        exact = call(model)
        for mode in ("fp8", "fp8-weight-only"):
            ctx.check(mode)
            fp8 = fp8_copy(model, mode)
            if fp8 is None:
                ctx.emit({"status": "skipped", "mode": mode, "reason": "not supported here"})
                continue
            ms = timed_ms(ctx, partial(call, fp8), repeat=ctx.args.repeat)
            eager = ctx.state.get("eager_ms", {}).get(size)
            peak = _forward_peak_gb(ctx, partial(call, fp8))
            got = call(fp8)
            weights = sum(p.numel() * p.element_size() for p in (*fp8.parameters(), *fp8.buffers()))
            ctx.emit(
                {
                    "status": "measured",
                    "mode": mode,
                    "fp8_layers": DEFAULT_PIPELINE.fp8_layers,
                    "modulation": MODULATION,
                    "gemm_scales": _gemm_scales(fp8, ctx.device),
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


def _gemm_scales(model: torch.nn.Module, device: torch.device) -> dict[str, int]:
    """How many of the FP8 model's layers run each way here (model.qwen_image.fp8: rowwise, tensorwise
    where the kernel refuses row-wise scales, weight-only)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        kind = getattr(m, "scale_kind", None)
        if callable(kind):
            name = kind(device)
            counts[name] = counts.get(name, 0) + 1
    return counts


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


# Beyond the budget's plan: run with --extra fp8_compiled.
@stage("fp8_compiled", estimate_s=120, limit_s=300, isolated=True, frees=("dit60",), optional=True)
def fp8_compiled(ctx: Context) -> None:
    """The FP8 DiT as a job runs it, compiled, at the main bucket, once per layer set ('safe',
    the default, and 'all'; model.fp8_layers): ms per forward against the bf16 eager and compiled
    lines, and the relative error of its output against the bf16 eager output. In a child process
    (a fresh compile each); optional (`--extra fp8_compiled`): it does not fit the budget's plan.
    On the CPU only the `--tiny` rehearsal runs it (Dynamo's eager backend)."""
    if not ctx.cuda and not ctx.tiny:
        raise StageSkipped("not on CPU: the compiled FP8 GEMMs are timed on a GPU")
    model = full_model(ctx)
    size = sizes(ctx)[0]
    call, _ = dit_call(ctx, model.config, size)
    with torch.no_grad():
        exact = call(model)
    # The bf16 compiled figure, read before compiled_forward_line records the FP8 one in its place.
    bf16_compiled = ctx.state.get("compiled_ms", {}).get(size)
    for layers in FP8_LAYER_SETS:
        ctx.check(f"fp8 {layers}")
        fp8 = fp8_copy(model, "fp8", layers)
        if fp8 is None:
            raise StageSkipped("this GPU cannot run fp8 (no FP8 matrix units)")
        report = compile_dit(ctx, fp8)
        line = compiled_forward_line(ctx, fp8, size, report, compiles_before=compile_count())
        with torch.no_grad():
            got = call(fp8)
        ctx.state["compiled_ms"].pop(size)  # the bf16 line's figure stays the only one kept
        if bf16_compiled:
            ctx.state["compiled_ms"][size] = bf16_compiled
        ctx.emit(
            {
                **line,
                "mode": "fp8",
                "fp8_layers": layers,
                "speedup_vs_bf16_compiled": round(bf16_compiled / line["ms_per_forward"], 3)
                if bf16_compiled
                else None,
                "rel_err_vs_bf16": round(rel_err(got, exact), 4),
                "gemm_scales": _gemm_scales(fp8, ctx.device),
            }
        )
        del fp8, got
