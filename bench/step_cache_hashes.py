"""sha256 of tiny-model images with the step cache off and with each preset and method on: run
before and after a change to the step cache's plumbing, and diff the outputs (they must match).

    python bench/step_cache_hashes.py > before.txt   # ... change ...
    python bench/step_cache_hashes.py | diff before.txt -
    python bench/step_cache_hashes.py fast teacache   # some cases only

Each line: case, cfg mode, size, steps, image index, sha256 of the fp32 image bytes, sha256 of the
uint8 image, and the image's DiT block evaluations computed/reused (what the cache decided).
"""

from __future__ import annotations

import hashlib
import logging
import sys

import torch

from ditfleet import load_pipeline
from ditfleet.model.step_cache_config import parse_step_cache

PROMPTS = [
    "a large blue square in the centre on a yellow background",
    "a small red circle top left on a green background",
    "a large green triangle bottom right on a white background",
]
# (name, setting, steps): presets need 20 steps (min_steps); the mappings lower min_steps and the
# warm-up so a short schedule reuses steps, and cover each method with and without TaylorSeer.
CASES = [
    ("off", "off", 10),
    ("off20", "off", 20),
    ("safe", "safe", 20),
    ("fast", "fast", 20),
    ("safe-short", "safe", 10),  # too short: runs exact
    ("dbcache", {"method": "dbcache", "threshold": 0.3, "warmup_steps": 2, "min_steps": 5}, 10),
    (
        "dbcache-ts2",
        {"method": "dbcache", "threshold": 0.3, "warmup_steps": 2, "min_steps": 5, "taylorseer_order": 2},
        10,
    ),
    (
        "teacache",
        {
            "method": "teacache",
            "threshold": 0.5,
            "warmup_steps": 2,
            "min_steps": 5,
            "max_consecutive_skips": 2,
        },
        10,
    ),
    ("teacache-ts1", {"preset": "fast", "warmup_steps": 2, "min_steps": 5}, 10),
    ("teacache-ts2", {"preset": "fast", "warmup_steps": 2, "min_steps": 5, "taylorseer_order": 2}, 10),
]
# (height, width, prompts, seeds, per-row CFG scales): prompts of different lengths pad the text.
BATCHES = [
    (128, 128, PROMPTS[:2], [0, 1], 3.0),
    (64, 96, PROMPTS, [5, 6, 7], [2.5, 4.0, 2.5]),
]


def _generate(pipe, setting, **kw):
    """Images (B, 3, H, W) and per-image {blocks_computed, blocks_reused} (None when off)."""
    from ditfleet.model.generation.pipeline import Sampling

    config = parse_step_cache(setting)
    if config is None:  # the public call, as the README shows it
        return pipe.generate(**kw), None
    inputs = pipe.encode_guidance(kw.pop("prompt"), None, kw["true_cfg_scale"])
    generation = pipe.with_step_cache(config).run(inputs, Sampling(**kw))
    cache = generation.step_cache
    return generation.images, None if cache is None else cache.per_image()


def main(only: list[str]) -> None:
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    for cfg_mode in ("serial", "batched"):
        for name, setting, steps in CASES:
            if only and name not in only:
                continue
            pipe = load_pipeline("tiny", cfg_mode=cfg_mode)
            for height, width, prompts, seeds, scale in BATCHES:
                images, counts = _generate(
                    pipe,
                    setting,
                    prompt=prompts,
                    height=height,
                    width=width,
                    steps=steps,
                    true_cfg_scale=scale,
                    seeds=seeds,
                )
                pixels = (images * 255).round().clamp(0, 255).to(torch.uint8)
                for i in range(images.shape[0]):
                    exact = hashlib.sha256(images[i].contiguous().numpy().tobytes()).hexdigest()[:16]
                    u8 = hashlib.sha256(pixels[i].contiguous().numpy().tobytes()).hexdigest()[:16]
                    c = counts[i] if counts else {}
                    print(
                        f"{name:13} {cfg_mode:8} {height}x{width} steps={steps} img={i} fp32={exact} "
                        f"u8={u8} computed={c.get('blocks_computed')} reused={c.get('blocks_reused')}",
                        flush=True,
                    )


if __name__ == "__main__":
    main(sys.argv[1:])  # case names to run; none: all
