"""The quality gate on the bundled tiny model: the 64 held-out captions at a 2-step schedule with
and without `quality.gate: {scorer: tiny, min: 1.0, max_tries: 3}`, against the 20-step exact
images, side by side in one run, through the worker's own path (no Ray).

    python bench/quality_gate.py                  # 64 captions at 128x128
    python bench/quality_gate.py --max-tries 2
    python bench/quality_gate.py --job-seeds 0 1 2 3 4 5   # six draws of the 64 images, pooled

Each variant's stored images are read back and judged twice:
- by an independent judge (ditfleet.testing.scene_judge: a palette vote for the colours and a
  least-squares fit of every shape kind the scenes' rasteriser draws, at every radius around the
  two sizes), which the gate never sees: the share of images
  whose shape colour, background, position, shape and size match the caption, and "all five", the
  share with every one right. This is the judge the gate is measured by.
- by the gate's own analysis (model.tiny.adherence.score, which the `tiny` scorer averages): the
  mean of its five attribute shares, and two measures the gate does not look at, the IoU with the
  ideal shape and the share of clean single-blob masks.
The DiT work is counted in denoising steps: tries x steps per image, against the 20-step
schedule's. With several job seeds (each another draw of the same 64 captions' images) the
variants are also pooled: shares and per-image counts averaged over the equal-sized draws. Prints
one line per variant and seed, the pooled lines, then one JSON line.
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
from ditfleet.testing.scene_judge import ATTRIBUTES, judge
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import GateConfig, WorkerConfig
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.rows import RowConfig, ShardSpec
from ditfleet.workers.storage import open_store

# The gate's own analysis's names for the same five attributes.
GATE_ATTRIBUTES = ("shape_color", "background", "position", "kind", "size")


def run_variant(
    prompts: Path, n: int, out: Path, steps: int, gate: GateConfig | None, bucket: str, job_seed: int
) -> dict:
    rows = RowConfig(
        job_seed=job_seed, buckets=BucketSet.from_names([bucket]), steps=steps, true_cfg_scale=2.0
    )
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
    prompts = [r["prompt"] for r in manifest]
    independent, own = judge(images, prompts), score(images, prompts)
    tries = sum(r["gate_tries"] or 1 for r in manifest)
    return {
        "steps": steps,
        "gate": None
        if gate is None
        else {"scorer": gate.scorer, "min": gate.min, "max_tries": gate.max_tries},
        "images": result.images_ok,
        "judge": {
            **{a: round(v, 4) for a, v in independent.items()},
            "attribute_mean": round(sum(independent[a] for a in ATTRIBUTES) / len(ATTRIBUTES), 4),
        },
        "gate_analysis": {
            "attribute_mean": round(sum(own[a] for a in GATE_ATTRIBUTES) / len(GATE_ATTRIBUTES), 4),
            "iou": round(own["iou"], 4),
            "one_blob": round(own["one_blob"], 4),
        },
        "tries_per_image": round(tries / len(manifest), 3),
        "dit_steps_per_image": round(tries * steps / len(manifest), 2),
        "passed": sum(bool(r["gate_passed"]) for r in manifest) if gate is not None else None,
        "wall_s": round(wall, 2),
    }


def _pool(runs: list[dict]) -> dict:
    """One variant over several equal-sized draws: shares and per-image counts averaged, images,
    passes and wall time summed."""

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 4)

    pooled = {"steps": runs[0]["steps"], "gate": runs[0]["gate"]}
    for part in ("judge", "gate_analysis"):
        pooled[part] = {key: mean([r[part][key] for r in runs]) for key in runs[0][part]}
    for key in ("tries_per_image", "dit_steps_per_image"):
        pooled[key] = mean([r[key] for r in runs])
    for key in ("images", "wall_s"):
        pooled[key] = round(sum(r[key] for r in runs), 2)
    pooled["passed"] = None if runs[0]["passed"] is None else sum(r["passed"] for r in runs)
    return pooled


def _line(name: str, r: dict) -> str:
    j, own = r["judge"], r["gate_analysis"]
    return (
        f"{name}: independent judge: all five right {j['all_five']:.1%} (colour {j['color']:.1%}, "
        f"background {j['background']:.1%}, position {j['position']:.1%}, shape {j['shape']:.1%}, "
        f"size {j['size']:.1%}; attribute mean {j['attribute_mean']:.1%}); gate's own analysis: "
        f"attribute mean {own['attribute_mean']:.1%}, IoU {own['iou']:.3f}, one blob {own['one_blob']:.1%}; "
        f"{r['tries_per_image']:.2f} tries, {r['dit_steps_per_image']:.2f} DiT steps per image"
    )


def _points(variant: dict, exact: dict) -> float:
    return round(100 * (variant["judge"]["all_five"] - exact["judge"]["all_five"]), 2)


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
    parser.add_argument(
        "--job-seeds", type=int, nargs="+", default=[0], help="one draw of the 64 images per seed (default 0)"
    )
    args = parser.parse_args(argv)
    captions = held_out_captions()
    gate = GateConfig("tiny", min=args.min, max_tries=args.max_tries)
    variants = [
        (f"exact {args.exact_steps} steps", args.exact_steps, None),
        (f"{args.steps} steps", args.steps, None),
        (f"{args.steps} steps + gate", args.steps, gate),
    ]
    runs: dict[str, dict[int, dict]] = {name: {} for name, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="ditfleet-gate-") as tmp:
        prompts = Path(tmp) / "prompts.parquet"
        pq.write_table(
            pa.table({"id": [f"h{i:02d}" for i in range(len(captions))], "prompt": captions}), prompts
        )
        for seed in args.job_seeds:
            for i, (name, steps, g) in enumerate(variants):
                out = Path(tmp) / f"seed{seed}-out{i}"
                r = run_variant(prompts, len(captions), out, steps, g, args.bucket, seed)
                runs[name][seed] = r
                print(f"job seed {seed}, {_line(name, r)}", flush=True)
    results = {name: _pool(list(by_seed.values())) for name, by_seed in runs.items()}
    if len(args.job_seeds) > 1:
        for name, r in results.items():
            print(f"pooled over {len(args.job_seeds)} seeds, {_line(name, r)}")
    exact, short, gated = (results[v[0]] for v in variants)
    print(
        json.dumps(
            {
                "bench": "quality_gate",
                "images": len(captions) * len(args.job_seeds),
                "bucket": args.bucket,
                "job_seeds": args.job_seeds,
                "variants": results,
                "per_seed": {name: {str(s): r for s, r in by_seed.items()} for name, by_seed in runs.items()},
                # Points of the independent judge's "all five right", pooled, against the 20-step images.
                "gated_vs_exact_points": _points(gated, exact),
                "short_vs_exact_points": _points(short, exact),
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
