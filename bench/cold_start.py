"""The README job from empty compile caches: every actor compiling every bucket vs compile
claims (each bucket compiled once per machine), side by side in one run.

    python bench/cold_start.py                 # jobs/examples/tiny.yaml, off then on
    python bench/cold_start.py --order on,off  # the other order (the machine warms up too)
    python bench/cold_start.py --repeat 2      # off, on, off, on: medians (a shared machine is noisy)

For each variant it runs `ditfleet run` on a copy of the job whose output, model cache and
Inductor cache (TORCHINDUCTOR_CACHE_DIR) are fresh temporary directories, without a shared
compile cache key (a fresh machine: nothing to load from anywhere). "off" sets
compile.claim_timeout_s: 0 (every actor compiles every bucket), "on" keeps the default.
It reports the whole job's wall time (the command, Ray start included) and, per actor,
warm-up seconds, the buckets it compiled (Inductor compiles > 0) and the ones it took from the
cache another actor filled. Prints one line per variant, then one JSON line.
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


def run_variant(job: Path, claims: bool, timeout_s: float) -> dict:
    doc = yaml.safe_load(job.read_text())
    with tempfile.TemporaryDirectory(prefix="ditfleet-cold-") as tmp:
        tmp_path = Path(tmp)
        # Relative paths start where ditfleet runs (the repository root here).
        doc["input"]["path"] = str((ROOT / doc["input"]["path"]).resolve())
        doc["output"]["uri"] = str(tmp_path / "out")
        doc.setdefault("model", {})["cache_dir"] = str(tmp_path / "models")
        doc.setdefault("compile", {})["claim_timeout_s"] = 600.0 if claims else 0
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
        "claims": claims,
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
    parser.add_argument("--order", default="off,on", help="variants in run order: off,on or on,off")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of both variants, interleaved")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    order = [v.strip() for v in args.order.split(",")]
    if sorted(order) != ["off", "on"]:
        parser.error(f"--order must name off and on once each, got {args.order!r}")
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(max(1, args.repeat)):
        for variant in order:
            r = run_variant(Path(args.job).resolve(), variant == "on", args.timeout)
            r["load_avg_1m"] = round(os.getloadavg()[0], 2)
            rounds[variant].append(r)
            per_actor = "; ".join(
                f"warm-up {a['warmup_s']:.1f} s, compiled {a['compiled']}, from cache {a['from_cache']}"
                for a in r["actors"].values()
            )
            print(
                f"claims {variant}: wall {r['wall_s']:.1f} s (job {r['job_wall_s']:.1f} s, load "
                f"{r['load_avg_1m']}), {per_actor}",
                flush=True,
            )
    mean = lambda r: sum(a["warmup_s"] for a in r["actors"].values()) / max(1, len(r["actors"]))  # noqa: E731
    med = {v: statistics.median(r["wall_s"] for r in rs) for v, rs in rounds.items()}
    out = {
        "bench": "cold_start",
        "job": str(Path(args.job)),
        "cpus": os.cpu_count(),
        "off": rounds["off"],
        "on": rounds["on"],
        "wall_s_median": med,
        "wall_speedup": round(med["off"] / med["on"], 2),
        "warmup_mean_s_median": {
            v: round(statistics.median(mean(r) for r in rs), 2) for v, rs in rounds.items()
        },
    }
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
