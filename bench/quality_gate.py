"""The quality gate on the bundled tiny model: the 64 held-out captions at a 2-step schedule with
and without `quality.gate: {scorer: tiny, min: 1.0, max_tries: 3}`, against the 20-step exact
images, side by side in one run, through the worker's own path (no Ray).

    python bench/quality_gate.py                  # 64 captions at 128x128
    python bench/quality_gate.py --max-tries 2

Each variant's stored images are read back and judged with the tiny model's adherence check
(model.tiny.adherence.score): the share of images whose colour, background, position, shape and
size match the caption (the gate's own score is the mean of those five, so this judge is not
independent of it), and two measures the gate does not look at: the IoU with the ideal shape and
the share of clean single-blob masks. The DiT work is counted in denoising steps: tries x steps
per image, against the 20-step schedule's. Prints one line per variant, then one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.model.tiny.adherence import score
from ditfleet.model.tiny.scenes import held_out_captions
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import GateConfig, WorkerConfig
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import RowConfig, ShardSpec
from ditfleet.workers.storage import open_store

ATTRIBUTES = ("shape_color", "background", "position", "kind", "size")


def run_variant(prompts: Path, n: int, out: Path, steps: int, gate: GateConfig | None, bucket: str) -> dict:
    rows = RowConfig(job_seed=0, buckets=BucketSet.from_names([bucket]), steps=steps, true_cfg_scale=2.0)
    config = WorkerConfig(
        output_uri=str(out), rows=rows, model_path="tiny", batch_size=8,
        compile=CompileConfig(vae=False, dit=False), gate=gate,
    )  # fmt: skip
    shard = ShardSpec(0, str(prompts), 0, n, 0, (bucket,), n)
    start = time.perf_counter()
    result = GenerationWorker(config).run_shard(shard)
    wall = time.perf_counter() - start
    store = open_store(str(out))
    manifest = read_manifests(store).to_pylist()
    images = torch.stack(
        [
            torch.from_numpy(
                np.array(Image.open(io.BytesIO(store.get(_key(store, r["uri"])))).convert("RGB"))
            )
            .permute(2, 0, 1)
            .float()
            / 255.0
            for r in manifest
        ]
    )  # (n, 3, H, W) in [0, 1], as stored
    judged = score(images, [r["prompt"] for r in manifest])
    tries = sum(r["gate_tries"] or 1 for r in manifest)
    return {
        "steps": steps,
        "gate": None
        if gate is None
        else {"scorer": gate.scorer, "min": gate.min, "max_tries": gate.max_tries},
        "images": result.images_ok,
        "all_five": round(sum(judged[a] for a in ATTRIBUTES) / len(ATTRIBUTES), 4),
        **{a: round(judged[a], 4) for a in ATTRIBUTES},
        "iou": round(judged["iou"], 4),
        "one_blob": round(judged["one_blob"], 4),
        "tries_per_image": round(tries / len(manifest), 3),
        "dit_steps_per_image": round(tries * steps / len(manifest), 2),
        "passed": sum(bool(r["gate_passed"]) for r in manifest) if gate is not None else None,
        "wall_s": round(wall, 2),
    }


def _key(store, uri: str) -> str:
    return uri.removeprefix(store.uri("")).lstrip("/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2, help="the short schedule (default 2)")
    parser.add_argument("--exact-steps", type=int, default=20, help="the reference schedule (default 20)")
    parser.add_argument("--max-tries", type=int, default=3)
    parser.add_argument("--min", type=float, default=1.0, help="the gate's lowest passing tiny score")
    parser.add_argument("--bucket", default="128x128")
    args = parser.parse_args(argv)
    captions = held_out_captions()
    gate = GateConfig("tiny", min=args.min, max_tries=args.max_tries)
    variants = [
        (f"exact {args.exact_steps} steps", args.exact_steps, None),
        (f"{args.steps} steps", args.steps, None),
        (f"{args.steps} steps + gate", args.steps, gate),
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ditfleet-gate-") as tmp:
        prompts = Path(tmp) / "prompts.parquet"
        pq.write_table(
            pa.table({"id": [f"h{i:02d}" for i in range(len(captions))], "prompt": captions}), prompts
        )
        for i, (name, steps, g) in enumerate(variants):
            r = run_variant(prompts, len(captions), Path(tmp) / f"out{i}", steps, g, args.bucket)
            results[name] = r
            print(
                f"{name}: all five attributes {r['all_five']:.1%} (colour {r['shape_color']:.1%}, background "
                f"{r['background']:.1%}, position {r['position']:.1%}, shape {r['kind']:.1%}, size {r['size']:.1%}), "
                f"IoU {r['iou']:.3f}, one blob {r['one_blob']:.1%}; {r['tries_per_image']:.2f} tries, "
                f"{r['dit_steps_per_image']:.2f} DiT steps per image",
                flush=True,
            )
    exact, short, gated = (results[v[0]] for v in variants)
    print(
        json.dumps(
            {
                "bench": "quality_gate",
                "images": len(captions),
                "bucket": args.bucket,
                "variants": results,
                "gated_vs_exact_points": round(100 * (gated["all_five"] - exact["all_five"]), 2),
                "short_vs_exact_points": round(100 * (short["all_five"] - exact["all_five"]), 2),
                "gated_dit_work_vs_short": round(
                    gated["dit_steps_per_image"] / short["dit_steps_per_image"], 3
                ),
                "gated_dit_work_vs_exact": round(
                    gated["dit_steps_per_image"] / exact["dit_steps_per_image"], 3
                ),
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
