"""Prompt adherence of a model on the 64 held-out captions, through the real pipeline.

    python -m model.tiny.evaluate --model tiny --steps 20 --cfg 4

Each caption gets a fixed seed (its index), so the numbers are reproducible.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from model.tiny.adherence import score
from model.tiny.scenes import held_out_captions


def generate_held_out(
    pipe,
    steps: int,
    true_cfg_scale: float,
    width: int = 128,
    height: int = 128,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, list[str]]:
    """Images (64, 3, height, width) in [0, 1] for the held-out captions, seeds seed + index."""
    captions = held_out_captions()
    images = []
    for start in range(0, len(captions), batch_size):
        chunk = captions[start : start + batch_size]
        seeds = list(range(seed + start, seed + start + len(chunk)))
        images.append(
            pipe.generate(
                prompt=chunk,
                height=height,
                width=width,
                steps=steps,
                true_cfg_scale=true_cfg_scale,
                seeds=seeds,
            )
        )
    return torch.cat(images), captions


def evaluate(
    pipe, steps: int, true_cfg_scale: float, width: int = 128, height: int = 128
) -> dict[str, float]:
    """Adherence on the held-out captions: fractions shape_color, background, position, kind, size,
    one_blob and the mean IoU with the ideal captioned shape (see `adherence.score`)."""
    images, captions = generate_held_out(pipe, steps, true_cfg_scale, width, height)
    return score(images, captions)


def main(argv: list[str] | None = None) -> None:
    from model import load_pipeline

    parser = argparse.ArgumentParser(description="Adherence of a model on the held-out scene captions.")
    parser.add_argument("--model", default="tiny", help="'tiny' or a diffusers-layout folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, default=4.0, help="true_cfg_scale")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model)
    for width, height in ((128, 128), (160, 96), (96, 160)):
        start = time.time()
        result = evaluate(pipe, args.steps, args.cfg, width, height)
        print(
            json.dumps(
                {
                    "bucket": f"{width}x{height}",
                    "steps": args.steps,
                    "cfg": args.cfg,
                    **{k: round(v, 4) for k, v in result.items()},
                    "seconds": round(time.time() - start, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
