"""The step cache side by side in one run: exact, then each preset, on the same prompts and seeds.

1. The bundled tiny model at 20 and 50 steps (held-out captions, 128x128, CFG 2): wall time, DiT
   block evaluations computed, and PSNR against the exact images, per preset. The runs of one
   schedule are interleaved round by round so machine noise hits them alike.
2. The real-width slice (Qwen-Image's published widths, hidden 3072 = 24 x 128, text 3584, one
   or two blocks, random weights, CPU): per preset, the decision's own cost (the signal, its
   relative L1 change, the stores, the reused residual) against one block's forward, and as a
   share of a 60-block step.

One JSON line per result.

    python bench/step_cache.py                    # both parts
    python bench/step_cache.py --images 8 --rounds 1 --real-blocks 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ditfleet.model import load_pipeline
from ditfleet.model.generation.pipeline import Sampling
from ditfleet.model.generation.step_cache import StepCache
from ditfleet.model.qwen_image.published import published_config
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.step_cache_config import PRESETS
from ditfleet.model.tiny.scenes import held_out_captions

PRESET_NAMES = ("safe", "fast")


def tiny(steps: int, images: int, rounds: int) -> list[dict]:
    pipe = load_pipeline("tiny")
    layers = pipe.transformer.config.num_layers
    caps = held_out_captions()[:: max(1, 64 // images)][:images]
    inputs = pipe.encode_guidance(caps, None, 2.0)
    sampling = Sampling(128, 128, steps, list(range(len(caps))), 2.0)
    pipe.run(inputs, Sampling(128, 128, 1, sampling.seeds, 2.0))  # untimed start-up
    times: dict[str, list[float]] = {name: [] for name in ("exact", *PRESET_NAMES)}
    ref = None
    counts: dict[str, tuple[int, int]] = {}
    psnrs: dict[str, float] = {}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            generation = pipe.with_step_cache(PRESETS.get(name)).run(inputs, sampling)
            times[name].append(time.perf_counter() - t0)
            out, cache = generation.images, generation.step_cache
            if name == "exact":
                ref = out
                counts[name] = (len(caps) * steps * 2 * layers, 0)
            else:
                assert cache is not None
                per = cache.per_image()
                counts[name] = (sum(p["blocks_computed"] for p in per), sum(p["blocks_reused"] for p in per))
                mse = ((out - ref) ** 2).flatten(1).mean(dim=1)
                psnrs[name] = float((10 * torch.log10(1 / mse)).mean())
    exact_s = min(times["exact"])
    results = []
    for name, ts in times.items():
        computed, reused = counts[name]
        results.append(
            {
                "bench": "step_cache",
                "model": "tiny",
                "steps": steps,
                "images": len(caps),
                "preset": name,
                "wall_s": round(min(ts), 3),
                "wall_speedup": round(exact_s / min(ts), 3),
                "blocks_computed": computed,
                "blocks_reused": reused,
                "work_speedup": round((computed + reused) / computed, 3),
                "psnr_mean_db": round(psnrs[name], 2) if name in psnrs else None,
            }
        )
    return results


def real_width(blocks: int, tokens: int, text: int, repeats: int) -> list[dict]:
    """The decision's cost at the published widths, against one block forward there."""
    cfg = published_config("qwen-image", "transformer/config.json")
    config = TransformerConfig.from_dict({**cfg, "num_layers": blocks})
    torch.manual_seed(0)
    dit = QwenImageTransformer(config).eval()
    side = int(tokens**0.5)
    latents = torch.randn(1, side * side, config.in_channels)
    embeds = torch.randn(1, text, config.joint_attention_dim)
    timestep = torch.tensor([0.5])
    shapes = [[(1, side, side)]]
    with torch.no_grad():
        dit(latents, embeds, None, timestep, shapes)  # warm
        t0 = time.perf_counter()
        for _ in range(repeats):
            dit(latents, embeds, None, timestep, shapes)
        forward_s = (time.perf_counter() - t0) / repeats
        # The decision and its bookkeeping for one row (one image, one branch) past warm-up,
        # per preset: making the signal, its relative change, the stores and the reused row's
        # residual (TaylorSeer's forecast included).
        D = config.num_attention_heads * config.attention_head_dim
        start = torch.randn(1, side * side, D)
        after = start + 0.1 * torch.randn_like(start)
        temb = torch.randn(1, D)
        decisions = {
            name: _decision_s(PRESETS[name], dit, start, after, temb, repeats * 10) for name in PRESET_NAMES
        }
    per_block = forward_s / blocks
    return [
        {
            "bench": "step_cache",
            "model": "real-width slice",
            "preset": name,
            "blocks": blocks,
            "image_tokens": side * side,
            "text_tokens": text,
            "forward_s": round(forward_s, 4),
            "per_block_s": round(per_block, 4),
            "decision_s": round(decision_s, 6),
            "decision_vs_block": round(decision_s / per_block, 4),
            "decision_share_of_60_block_step": round(decision_s / (60 * per_block), 5),
        }
        for name, decision_s in decisions.items()
    ]


def _decision_s(config, dit, start, after, temb, repeats: int) -> float:
    """Seconds per decision of one row at step 20 of 50, its state primed by one computed step."""
    cache = StepCache(config, 60)
    cache.start(50, 1)
    block = dit.transformer_blocks[0]

    def signal() -> torch.Tensor:
        if config.method == "teacache":
            img_mod, _ = block.modulation(temb, None, None)
            return block.modulated_input(after, img_mod)
        return after - start

    rows = cache.call(18, (0,))
    assert rows is not None
    rows._remember([0], after - start)
    rows = cache.call(19, (0,))
    assert rows is not None
    rows._scatter("signal", [0], signal())
    rows._remember([0], after - start)  # two computed steps: TaylorSeer has a derivative
    rows = cache.call(20, (0,))
    assert rows is not None
    t0 = time.perf_counter()
    for _ in range(repeats):
        rows.decide(signal())
        rows._scatter("signal", [0], signal())
        _ = after + rows._forecast([0])
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    ap.add_argument("--real-blocks", type=int, default=1)
    ap.add_argument("--real-tokens", type=int, default=1024)
    ap.add_argument("--real-text", type=int, default=64)
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    results = []
    for steps in args.steps:
        results += tiny(steps, args.images, args.rounds)
    if not args.skip_real:
        results += real_width(args.real_blocks, args.real_tokens, args.real_text, repeats=3)
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
