"""Latency of one 128x128 image from the bundled tiny model on one CPU core, CFG and cache on.

    python bench/tiny_latency.py [--steps 20] [--rounds 5]

Prints the median seconds per image over several rounds, with the modulation cache off and on
side by side, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ditfleet.model import load_pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipe = load_pipeline("tiny", modulation_cache="cfg")
    prompt = ["a large red circle at the centre on a blue background"]

    def one(mode: str) -> float:
        pipe.set_modulation_cache(mode)
        t0 = time.perf_counter()
        pipe.generate(
            prompt=prompt, height=args.size, width=args.size, steps=args.steps, true_cfg_scale=4.0, seeds=[0]
        )
        return time.perf_counter() - t0

    one("cfg")  # first call: allocator and kernel selection
    times: dict[str, list[float]] = {"off": [], "cfg": []}
    for _ in range(args.rounds):
        for mode in times:
            times[mode].append(one(mode))
    med = {m: statistics.median(v) for m, v in times.items()}
    for m, v in med.items():
        print(
            f"modulation cache {m:<4}: {v:.3f} s per {args.size}x{args.size} image ({args.steps} steps, CFG 4, 1 thread)"
        )
    print(
        json.dumps(
            {
                "bench": "tiny_latency",
                "steps": args.steps,
                "size": args.size,
                "s_per_image": {m: round(v, 4) for m, v in med.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
