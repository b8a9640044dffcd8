"""How long `ditfleet verify` and the driver's orphan cleanup take on an output of many objects.

Builds a synthetic "files"-format output in a temporary directory (random bytes as images, one
manifest per shard, `_job.json`, and one orphan run per shard), then times:
- verify_output with hashing (reads every object), and without (`--no-hash`: listing only);
- clean_orphans over every shard (what the driver does before `_SUCCESS`).

    python -m bench.verify_scan --shards 40 --images 250 --bytes 4096 --repeat 5
    python -m bench.verify_scan --shards 4000 --images 250 --bytes 512 --workers 1 2 4   # 1M objects

Each verify is timed `--repeat` times and the best time is kept (a shared machine's noise only
ever adds time). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

from ditfleet.driver.output.verify import VerifyReport, clean_orphans, verify_output
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.layout import image_key, job_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store


def build(root: str, shards: int, images: int, size: int) -> None:
    store = open_store(root)
    for shard in range(shards):
        token, loser = new_attempt_token(0), new_attempt_token(1)
        writer = ManifestWriter(shard, expected_rows=images)
        for i in range(images):
            row_id = f"r{shard:05d}-{i:05d}"
            stored = put_image(store, image_key(shard, token, row_id, None, "png"), os.urandom(size))
            if i % 10 == 0:  # a losing run stored a tenth of the shard before it lost
                store.put(image_key(shard, loser, row_id, None, "png"), os.urandom(size))
            writer.add(
                manifest_row(row_id, shard, stored, prompt="p", seed=i, model_id="bench", worker="bench")
            )
        writer.commit(store)
    plan = {"shards": shards, "rows": shards * images, "images": shards * images}
    store.put(job_key(), json.dumps({"fingerprint": "bench", "plan": plan}).encode())


def _best(repeat: int, run: Callable[[], VerifyReport]) -> tuple[float, VerifyReport]:
    """(best seconds of `repeat` runs, the last report)."""
    times = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        report = run()
        times.append(time.perf_counter() - start)
    return min(times), report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--images", type=int, default=250)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="time each verify this often, keep the best")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="verify threads: each count timed side by side on the same output (hashing), then the rest as usual",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verify-scan-") as root:
        build(root, args.shards, args.images, args.bytes)
        store = open_store(root)
        by_workers = {}
        for n in args.workers or []:
            seconds, report = _best(args.repeat, lambda n=n: verify_output(store, partial=True, workers=n))
            by_workers[n] = {
                "verify_hash_s": round(seconds, 3),
                "objects_per_s": round(report.objects_checked / seconds, 1),
            }
        hash_s, hashed = _best(args.repeat, lambda: verify_output(store, partial=True))
        no_hash_s, listed = _best(args.repeat, lambda: verify_output(store, partial=True, hash_objects=False))
        t2 = time.perf_counter()
        removed = clean_orphans(store, range(args.shards))
        t3 = time.perf_counter()
        assert not hashed.problems and hashed.objects_checked == args.shards * args.images, hashed.problems[
            :3
        ]
        assert removed == len(hashed.orphans) == len(listed.orphans)
        print(
            json.dumps(
                {
                    "bench": "verify_scan",
                    "shards": args.shards,
                    "objects": args.shards * args.images,
                    "orphans": removed,
                    "verify_hash_s": round(hash_s, 3),
                    "verify_hash_objects_per_s": round(hashed.objects_checked / hash_s, 1),
                    "verify_no_hash_s": round(no_hash_s, 3),
                    "clean_orphans_s": round(t3 - t2, 3),
                    **(
                        {"by_workers": by_workers, "load_avg_1m": round(os.getloadavg()[0], 2)}
                        if by_workers
                        else {}
                    ),
                }
            )
        )


if __name__ == "__main__":
    main()
