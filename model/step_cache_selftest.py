"""The node self-test's step-cache line (workers.selftest, stage "step_cache"): one image on the
node's model at one size, exact and with each preset, same seed and prompt embeddings.

It reports per preset the DiT work and wall-time speed-ups against exact, and how far the final
latents moved (relative L2). The self-test's weights are random, so the distance says nothing of
a real model's quality (`ditfleet calibrate` measures that); the wall-time speed-up next to the
work speed-up shows what the decisions, the batch subsets and the kept residuals cost on the GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .step_cache import StepCache
from .step_cache_config import PRESETS

_TEXT_TOKENS = 64
_CFG = 4.0


def selftest_line(pipe: Any, size: int, steps: int) -> dict[str, Any]:
    """{"size", "steps", "exact_s", "presets": {name: {...}}} for the self-test to print."""
    cfg = pipe.transformer.config
    g = torch.Generator().manual_seed(3)
    inputs = dict(
        prompt_embeds=torch.randn(1, _TEXT_TOKENS, cfg.joint_attention_dim, generator=g),
        prompt_embeds_mask=None,
        negative_prompt_embeds=torch.randn(1, _TEXT_TOKENS // 2, cfg.joint_attention_dim, generator=g),
        negative_prompt_embeds_mask=None,
        height=size,
        width=size,
        true_cfg_scale=_CFG,
        seeds=[0],
        decode=False,
    )
    layers = cfg.num_layers

    def run(hook: StepCache | None, n: int = steps) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            latents = pipe.generate(**inputs, steps=n, step_hook=hook).float().cpu()  # .cpu() waits
        return latents, time.perf_counter() - t0

    run(None, 1)  # one-off costs out of the timings
    exact, exact_s = run(None)
    line: dict[str, Any] = {
        "size": f"{size}x{size}",
        "steps": steps,
        "exact_s": round(exact_s, 3),
        "presets": {},
    }
    for name, config in PRESETS.items():
        if config is None:
            continue
        hook = StepCache(config, layers)
        latents, seconds = run(hook)
        per = hook.per_image()[0]
        total = per["blocks_computed"] + per["blocks_reused"]
        line["presets"][name] = {
            "active": hook.inactive is None,
            "work_speedup": round(total / max(1, per["blocks_computed"]), 3),
            "wall_speedup": round(exact_s / seconds, 3),
            "latent_rel_l2": round(float((latents - exact).norm() / exact.norm()), 4),
        }
    return line
