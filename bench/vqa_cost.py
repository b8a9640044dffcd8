"""What the vqa scorer costs per image against one DiT step at the same size, at Qwen-Image's
published widths with random weights (CPU by default).

Each model is cut to a few layers and timed at two depths, so the cost per layer and the fixed
cost (embeddings, patching, the LM head at one position) are measured and the full published
depth (DiT 60 blocks; Qwen2.5-VL 28 decoder layers, 32 vision blocks) extrapolated from them:

    vqa(L, V) = fixed + L * per_llm_layer + V * per_vision_block   (three depths)
    dit(n)    = fixed + n * per_block                              (two depths)

One DiT step is two forwards (true CFG, serial; the modulation cache does not change the
blocks' work). Times are CPU time of this process (time.process_time; median of --repeat).

    python bench/vqa_cost.py --size 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from ditfleet.model.quality.vqa import VQAScore
from ditfleet.model.qwen_image.transformer import TransformerConfig
from ditfleet.workers.selftest.parts import FAMILY, dit_inputs, make_transformer
from ditfleet.workers.selftest.vqa import PROMPT, encoder_config, make_encoder

LLM_FULL, VISION_FULL, DIT_FULL = 28, 32, 60


def cpu_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1000)
    return statistics.median(times)


def vqa_ms(size: int, llm: int, vision: int, repeat: int) -> float:
    encoder = make_encoder(encoder_config(False, llm, vision), torch.device("cpu"), torch.float32)
    scorer = VQAScore.from_text_encoder(encoder)
    image = torch.randint(
        0, 256, (1, 3, size, size), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    return cpu_ms(lambda: scorer.score(image, [PROMPT]), repeat)


def dit_ms(size: int, blocks: int, text_len: int, repeat: int) -> float:
    cfg = TransformerConfig.from_dict(FAMILY.published_config("transformer/config.json", blocks))
    model = make_transformer(cfg, torch.device("cpu"), torch.float32)
    x, txt, shapes = dit_inputs(cfg, size, text_len, 1, "cpu", torch.float32)
    t = torch.full((1,), 0.5)
    with torch.no_grad():
        return cpu_ms(lambda: model(x, txt, None, t, shapes), repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--text-len", type=int, default=64, help="prompt tokens the DiT sees")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    with torch.no_grad():
        a, b, c = (vqa_ms(args.size, *d, args.repeat) for d in ((1, 2), (2, 2), (1, 4)))
    per_llm, per_vision = b - a, (c - a) / 2
    vqa_fixed = a - per_llm - 2 * per_vision
    vqa_full = vqa_fixed + LLM_FULL * per_llm + VISION_FULL * per_vision
    d1, d2 = (
        dit_ms(args.size, 1, args.text_len, args.repeat),
        dit_ms(args.size, 2, args.text_len, args.repeat),
    )
    dit_fixed, per_block = d1 - (d2 - d1), d2 - d1
    step_full = 2 * (dit_fixed + DIT_FULL * per_block)
    result = {
        "bench": "vqa_cost",
        "size": args.size,
        "device": "cpu",
        "dtype": "fp32",
        "vqa_ms": {"llm1_vision2": round(a, 1), "llm2_vision2": round(b, 1), "llm1_vision4": round(c, 1)},
        "vqa_ms_per_llm_layer": round(per_llm, 1),
        "vqa_ms_per_vision_block": round(per_vision, 1),
        "vqa_ms_full_depth": round(vqa_full, 1),
        "dit_ms": {"1_block": round(d1, 1), "2_blocks": round(d2, 1)},
        "dit_ms_per_block": round(per_block, 1),
        "cfg_step_ms_full_depth": round(step_full, 1),
        "vqa_per_cfg_step_full_depth": round(vqa_full / step_full, 3),
        "vqa_per_cfg_step_cut": round(b / (2 * d2), 3),
    }
    print(
        f"{args.size}x{args.size} on the CPU (fp32): vqa {vqa_full:.0f} ms per image at full depth "
        f"({per_llm:.0f} ms per LM layer, {per_vision:.0f} ms per vision block), one CFG step of the "
        f"60-block DiT {step_full:.0f} ms: vqa = {vqa_full / step_full:.3f} CFG steps"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
