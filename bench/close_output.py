"""What fencing costs the driver at its finish: the one deletion rule alone vs the whole close.

Builds a synthetic "files"-format output (one manifest per shard, a losing run's objects in each,
`_job.json`, and one older lease document left unsettled by a crashed run over every shard), then
times, each on a fresh copy of the same output, side by side:
- `delete_lost` over every shard: the clean-up every finish has always done;
- `close_output` under a lease: settling the older document, sealing, the supersession pass, the
  same clean-up and the lease checks (`_SUCCESS`, one PUT, left out).
The difference is the cost of the integrity rules (docs/reliability.md), in driver CPU seconds
per 1,000 shards. With `--redone N` the first N shards also hold a committed redo (generation 1)
that the close supersedes; `close_again` then times a second close of the same output, which
reads their tombstones (the state every later finish and `verify --clean` sees).

    python -m bench.close_output --shards 1000 --images 4 [--redone 100]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import time

from bench.verify_scan import build
from ditfleet.driver.output.finish import close_output
from ditfleet.driver.output.lease import acquire_lease
from ditfleet.driver.output.orphans import delete_lost
from ditfleet.driver.output.settle import settle_older
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.layout import image_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store


def _redo(root: str, shards: int, images: int) -> None:
    """A committed redo (generation 1) of each of the first `shards` shards."""
    store = open_store(root)
    for shard in range(shards):
        token = new_attempt_token(0, 1)
        writer = ManifestWriter(shard, generation=1, expected_rows=images)
        for i in range(images):
            row_id = f"r{shard:05d}-{i:05d}"
            stored = put_image(store, image_key(shard, token, row_id, None, "png"), os.urandom(64))
            writer.add(
                manifest_row(row_id, shard, stored, prompt="p", seed=i, model_id="bench", worker="bench")
            )
        writer.commit(store)


def _crashed_run(root: str, shards: int) -> None:
    """An older lease document of a run that died before it settled: its shards to clean."""
    store = open_store(root)
    lease = acquire_lease(store, renew=False)
    lease.record_work(range(shards), {})
    # Killed: never released or settled; its expiry passes.
    doc = json.loads(store.get(lease.key))
    store.put(lease.key, json.dumps({**doc, "expires_at": 0}).encode())


def _timed(run) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return time.process_time() - cpu, time.perf_counter() - wall


def _close(root: str) -> None:
    store = open_store(root)
    lease = acquire_lease(store, renew=False)
    settled = settle_older(store, lease.generation)
    close_output(store, lease=lease, settled=settled, own=(), redo={}, success=None, out=io.StringIO())
    lease.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--redone", type=int, default=0, help="shards with a committed redo to supersede")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="close-output-") as tmp:
        base = os.path.join(tmp, "base")
        build(base, args.shards, args.images, 64)
        _redo(base, args.redone, args.images)
        _crashed_run(base, args.shards)
        runs = {}
        for name, run in (
            ("delete_lost", lambda root: delete_lost(open_store(root), range(args.shards))),
            ("close_output", _close),
        ):
            root = os.path.join(tmp, name)
            shutil.copytree(base, root)
            cpu, wall = _timed(lambda root=root, run=run: run(root))
            runs[name] = {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
            print(
                json.dumps({"bench": "close_output", "stage": name, "shards": args.shards, **runs[name]}),
                flush=True,
            )
        if args.redone:
            root = os.path.join(tmp, "close_output")
            cpu, wall = _timed(lambda: _close(root))
            runs["close_again"] = {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
            print(
                json.dumps({"bench": "close_output", "stage": "close_again", **runs["close_again"]}),
                flush=True,
            )
        per_1000 = 1000 / args.shards
        print(
            json.dumps(
                {
                    "bench": "close_output",
                    "shards": args.shards,
                    "redone": args.redone,
                    **(
                        {
                            "close_again_cpu_s_per_1000_shards": round(
                                runs["close_again"]["cpu_s"] * per_1000, 3
                            )
                        }
                        if args.redone
                        else {}
                    ),
                    "delete_lost_cpu_s_per_1000_shards": round(runs["delete_lost"]["cpu_s"] * per_1000, 3),
                    "close_output_cpu_s_per_1000_shards": round(runs["close_output"]["cpu_s"] * per_1000, 3),
                    "ratio_cpu": round(
                        runs["close_output"]["cpu_s"] / max(runs["delete_lost"]["cpu_s"], 1e-9), 2
                    ),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
