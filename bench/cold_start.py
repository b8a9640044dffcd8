"""The README job's first run on a machine, from empty caches, in variants side by side in one run:

    python bench/cold_start.py                                # default,compiled
    python bench/cold_start.py --variants compiled,no-claims  # what compile claims save
    python bench/cold_start.py --repeat 2                     # interleaved rounds: medians

Variants (each a copy of the job with one setting changed):
- default: the job as shipped (compile.vae auto: off on CPU actors);
- compiled: compile.vae true, compile claims on (each bucket compiled once per machine);
- no-claims: compile.vae true, compile.claim_timeout_s 0 (every actor compiles every bucket).

For each it runs `ditfleet run` on a copy of the job whose output, model cache and Inductor cache
(TORCHINDUCTOR_CACHE_DIR) are fresh temporary directories, without a shared compile cache key (a
fresh machine: nothing to load from anywhere). It reports the whole job's wall time (the command,
Ray start included) and, per actor, warm-up seconds, the buckets it compiled (Inductor compiles >
0) and the ones it took from the cache another actor filled. Prints one line per variant, then one
JSON line with the medians and each variant's wall time over the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


# variant -> the compile settings it sets (None: the job's own)
VARIANTS: dict[str, dict | None] = {
    "default": None,
    "compiled": {"vae": True, "claim_timeout_s": 600.0},
    "no-claims": {"vae": True, "claim_timeout_s": 0},
}


def run_variant(job: Path, variant: str, timeout_s: float) -> dict:
    doc = yaml.safe_load(job.read_text())
    with tempfile.TemporaryDirectory(prefix="ditfleet-cold-") as tmp:
        tmp_path = Path(tmp)
        # Relative paths start where ditfleet runs (the repository root here).
        doc["input"]["path"] = str((ROOT / doc["input"]["path"]).resolve())
        doc["output"]["uri"] = str(tmp_path / "out")
        doc.setdefault("model", {})["cache_dir"] = str(tmp_path / "models")
        doc.setdefault("compile", {}).update(VARIANTS[variant] or {})
        job_copy = tmp_path / "job.yaml"
        job_copy.write_text(yaml.safe_dump(doc))
        env = {k: v for k, v in os.environ.items() if k != "DITFLEET_COMPILE_CACHE_KEY"}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "ditfleet.jobs.cli", "run", str(job_copy)]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    actors = {}
    for worker, report in sorted(summary["startup"]["per_worker"].items()):
        warm = ((report.get("compile") or {}).get("warmup") or {}).get("buckets") or []
        actors[worker] = {
            "ready_s": report.get("ready_s"),
            "load_s": report.get("load_s"),
            "warmup_s": round(sum(b["seconds"] for b in warm), 3),
            "compiled": [b["bucket"] for b in warm if b.get("inductor_compiles", 0) > 0],
            "from_cache": [b["bucket"] for b in warm if b.get("inductor_compiles", 0) == 0],
            "waited_s": round(sum(b.get("waited_s", 0.0) for b in warm), 3),
            # in warm-up order: [bucket, seconds (waiting included), claim, Inductor compiles]
            "buckets": [
                [b["bucket"], round(b["seconds"], 2), b.get("claim", "off"), b.get("inductor_compiles", 0)]
                for b in warm
            ],
        }
    return {
        "variant": variant,
        "compile": doc["compile"],
        "wall_s": round(wall, 2),
        "job_wall_s": summary["timings"]["wall_s"],
        "images_ok": summary["images"]["ok"],
        "recompiles": summary["recompiles"],
        "actors": actors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", default=str(ROOT / "jobs/examples/tiny.yaml"))
    parser.add_argument("--variants", default="default,compiled", help=f"in run order, of {sorted(VARIANTS)}")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every variant, interleaved")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    order = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in order if v not in VARIANTS]
    if unknown or len(set(order)) != len(order):
        parser.error(f"--variants must name distinct variants of {sorted(VARIANTS)}, got {args.variants!r}")
    rounds: dict[str, list[dict]] = {v: [] for v in order}
    for _ in range(max(1, args.repeat)):
        for variant in order:
            r = run_variant(Path(args.job).resolve(), variant, args.timeout)
            r["load_avg_1m"] = round(os.getloadavg()[0], 2)
            rounds[variant].append(r)
            per_actor = "; ".join(
                f"warm-up {a['warmup_s']:.1f} s, compiled {a['compiled']}, from cache {a['from_cache']}"
                for a in r["actors"].values()
            )
            print(
                f"{variant}: wall {r['wall_s']:.1f} s (job {r['job_wall_s']:.1f} s, load "
                f"{r['load_avg_1m']}), {r['images_ok']} images; {per_actor}",
                flush=True,
            )
    mean = lambda r: sum(a["warmup_s"] for a in r["actors"].values()) / max(1, len(r["actors"]))  # noqa: E731
    med = {v: statistics.median(r["wall_s"] for r in rs) for v, rs in rounds.items()}
    out = {
        "bench": "cold_start",
        "job": str(Path(args.job)),
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "wall_s_median": med,
        "wall_over_first": {v: round(med[v] / med[order[0]], 2) for v in order},
        "warmup_mean_s_median": {
            v: round(statistics.median(mean(r) for r in rs), 2) for v, rs in rounds.items()
        },
    }
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
