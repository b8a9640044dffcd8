"""How long `ditfleet verify` and the driver's orphan cleanup take on an output of many objects.

Builds a synthetic "files"-format output in a temporary directory (random bytes as images, one
manifest per shard, `_job.json`, and one orphan run per shard), then times:
- verify_output with hashing (reads every object), at each `--workers` count side by side;
- verify_output without hashing (`--no-hash`: listing only);
- delete_lost over every shard (the one deletion rule: what the driver does before `_SUCCESS`).

    python -m bench.verify_scan --shards 40 --images 250 --bytes 4096 --repeat 5
    python -m bench.verify_scan --shards 4000 --images 250 --bytes 512 --workers 1 2 4   # 1M objects
    python -m bench.verify_scan --shards 400 --images 250 --bytes 512 --workers 1 2 --ray 2   # + Ray tasks

Each verify is timed `--repeat` times and the best time is kept (a shared machine's noise only
ever adds time). Prints one JSON line per measurement as soon as it has it (the build of a
1M-object output alone takes minutes, the whole run on 2 cores most of an hour), then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ditfleet.driver.output.orphans import delete_lost
from ditfleet.driver.output.verify import verify_output
from ditfleet.driver.output.verify_report import VerifyReport
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import job_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import ObjectStore, open_store


def build(root: str, shards: int, images: int, size: int, threads: int = 4) -> None:
    store = open_store(root)
    # Shards are independent: build them on a few threads (file writes release the GIL).
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda shard: _build_shard(store, shard, images, size), range(shards)))
    plan = {"shards": shards, "rows": shards * images, "images": shards * images}
    store.put(job_key(), json.dumps({"fingerprint": "bench", "plan": plan}).encode())


def _build_shard(store: ObjectStore, shard: int, images: int, size: int) -> None:
    token, loser = new_attempt_token(0), new_attempt_token(1)
    writer = ManifestWriter(shard, expected_rows=images)
    for i in range(images):
        row_id = f"r{shard:05d}-{i:05d}"
        stored = put_image(store, image_key(shard, token, row_id, None, "png"), os.urandom(size))
        if i % 10 == 0:  # a losing run stored a tenth of the shard before it lost
            store.put(image_key(shard, loser, row_id, None, "png"), os.urandom(size))
        writer.add(manifest_row(row_id, shard, stored, prompt="p", seed=i, model_id="bench", worker="bench"))
    writer.commit(store)


def _best(repeat: int, run: Callable[[], VerifyReport]) -> tuple[float, VerifyReport]:
    """(best seconds of `repeat` runs, the last report)."""
    times = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        report = run()
        times.append(time.perf_counter() - start)
    return min(times), report


def _ray_pass(root: str, args: argparse.Namespace) -> dict:
    """verify_output with its per-shard checks as Ray tasks on a local Ray (127.0.0.1)."""
    import ray

    from ditfleet.driver.output.verify_ray import RayChecks

    ray.init(
        address="local",
        num_cpus=args.ray,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        store = open_store(root)
        verify_output(store, partial=True, shard_checks=RayChecks(root, groups=args.ray))  # workers start
        objects = args.shards * args.images
        seconds, report = _best(
            args.repeat, lambda: verify_output(store, partial=True, shard_checks=RayChecks(root))
        )
        assert not report.problems and report.objects_checked == objects, report.problems[:3]
        return {"verify_hash_s": round(seconds, 3), "objects_per_s": round(objects / seconds, 1)}
    finally:
        ray.shutdown()


def _emit(**line: object) -> None:
    print(
        json.dumps({"bench": "verify_scan", **line, "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True
    )


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
        help="verify threads: each count timed side by side on the same output (hashing)",
    )
    parser.add_argument(
        "--ray",
        type=int,
        metavar="CPUS",
        help="also time `verify --ray` (driver.output.verify_ray) on a local Ray of this many CPUs: "
        "processes instead of threads, so no GIL between the checks",
    )
    args = parser.parse_args()
    objects = args.shards * args.images
    with tempfile.TemporaryDirectory(prefix="verify-scan-") as root:
        t0 = time.perf_counter()
        build(root, args.shards, args.images, args.bytes)
        _emit(stage="build", shards=args.shards, objects=objects, seconds=round(time.perf_counter() - t0, 1))
        store = open_store(root)
        by_workers = {}
        for n in args.workers or []:
            seconds, report = _best(args.repeat, lambda n=n: verify_output(store, partial=True, workers=n))
            assert not report.problems and report.objects_checked == objects, report.problems[:3]
            by_workers[n] = {"verify_hash_s": round(seconds, 3), "objects_per_s": round(objects / seconds, 1)}
            _emit(stage="verify_hash", workers=n, objects=objects, **by_workers[n])
        if args.ray:
            _emit(stage="verify_hash_ray", cpus=args.ray, objects=objects, **_ray_pass(root, args))
        hash_s, hashed = _best(args.repeat, lambda: verify_output(store, partial=True))
        assert not hashed.problems and hashed.objects_checked == objects, hashed.problems[:3]
        _emit(stage="verify_hash", workers="default", objects=objects, verify_hash_s=round(hash_s, 3))
        no_hash_s, listed = _best(args.repeat, lambda: verify_output(store, partial=True, hash_objects=False))
        _emit(stage="verify_no_hash", objects=objects, verify_no_hash_s=round(no_hash_s, 3))
        t2 = time.perf_counter()
        removed = delete_lost(store, range(args.shards))
        clean_s = time.perf_counter() - t2
        assert removed == len(hashed.orphans) == len(listed.orphans)
        _emit(stage="clean_orphans", orphans=removed, clean_orphans_s=round(clean_s, 3))
        _emit(
            stage="summary",
            shards=args.shards,
            objects=objects,
            orphans=removed,
            verify_hash_s=round(hash_s, 3),
            verify_hash_objects_per_s=round(objects / hash_s, 1),
            verify_no_hash_s=round(no_hash_s, 3),
            clean_orphans_s=round(clean_s, 3),
            **({"by_workers": by_workers} if by_workers else {}),
        )


if __name__ == "__main__":
    main()
