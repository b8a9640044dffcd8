"""A separate process that fetches a model, as one actor of a node would.

    python -m tests.support.model_fetch_child '<json>'

The JSON gives `source` (or `sources`, fetched one after the other), `cache_dir`, `s3` (S3Config fields), `fetch` (FetchConfig fields) and
optionally `kill_after_bytes` (SIGKILL itself once that many bytes have arrived: a node losing an
actor mid-download) and `wait_for_go` (print "ready", then start only when stdin says "go", so
two processes start their fetches at the same moment). Prints one JSON line per source: the
FetchedModel, or {"error": message, "type": class name}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.fetch import FetchConfig, ModelFetchError, fetch_model


def main(args: dict) -> None:
    progress = None
    if args.get("kill_after_bytes") is not None:
        received = [0]
        lock = threading.Lock()

        def progress(n: int) -> None:
            with lock:
                received[0] += n
                if received[0] >= args["kill_after_bytes"]:
                    os.kill(os.getpid(), signal.SIGKILL)

    if args.get("wait_for_go"):
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
    for source in args.get("sources", [args.get("source")]):
        try:
            fetched = fetch_model(
                source,
                args["cache_dir"],
                S3Config(**args.get("s3", {})),
                FetchConfig(**args.get("fetch", {})),
                progress=progress,
            )
            print(json.dumps(fetched.to_dict()), flush=True)
        except ModelFetchError as e:
            print(json.dumps({"error": str(e), "type": type(e).__name__}), flush=True)


if __name__ == "__main__":
    if os.environ.get("BLOCK_IMPORT"):
        # A node without an optional package: importing it fails as if it were not installed.
        for name in os.environ["BLOCK_IMPORT"].split(","):
            sys.modules[name] = None  # type: ignore[assignment]
    main(json.loads(sys.argv[1]))
