"""The processes of the pause and kill tests: `python -m tests.support.fence_entry SPEC.json`.

SPEC is JSON; its "mode" says what the process is:

- "run": a driver, `driver.run_job.run_job` with the stand-in FormatWorker
  (tests/support/format_worker.py). The shards run in this process, one after another (the
  dispatch is not what these tests are about, and a driver process without Ray is cheap to
  start, pause and kill); the driver around them is the real one. Exits with the summary's exit
  code, 1 with the error on stderr when run_job raises.
- "worker": one run of one shard on the stand-in worker, as an actor of some driver would run it
  ("shard", "attempt", "generation"): a twin, or a straggler that outlives its driver.
- "cli": `ditfleet ARGV...` ("argv").

Common keys: "input", "output", "endpoint_url" (an S3 output), "shard_size", "format" (files,
parquet, webdataset), "incremental", "redo" (shards), "pause_shards" (the stand-in worker stops
before committing these), "checked_before_commit" (it runs a committed shard too). Pauses:
DITFLEET_PAUSE_AT / DITFLEET_PAUSE_DIR (tests/support/pause_seam.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

ROWS_SEED = 7


def _s3(spec: dict[str, Any]):
    from ditfleet.workers.storage import S3Config

    if spec.get("endpoint_url"):
        return S3Config(endpoint_url=spec["endpoint_url"], region="us-east-1", addressing_style="path")
    return S3Config()


def driver_config(spec: dict[str, Any]):
    from ditfleet.driver.plan import PlanConfig
    from ditfleet.driver.run_job import DriverConfig
    from tests.support.worker_fixtures import row_config

    return DriverConfig(
        input_uri=spec["input"],
        output_uri=spec["output"],
        plan=PlanConfig(rows=row_config(), shard_size=int(spec.get("shard_size", 2))),
        s3=_s3(spec),
        resolved_spec=json.dumps({"name": "fence-tests", "format": spec.get("format", "parquet")}),
        incremental=bool(spec.get("incremental")),
        redo_shards=tuple(spec.get("redo", ())),
    )


def worker_config(spec: dict[str, Any]):
    from ditfleet.workers.output.formats import ShardWriterConfig
    from tests.support.format_worker import FormatWorkerConfig
    from tests.support.worker_fixtures import row_config

    return FormatWorkerConfig(
        output_uri=spec["output"],
        rows=row_config(),
        writer=ShardWriterConfig(output_format=spec.get("format", "parquet"), threads=2, max_in_flight=4),
        s3=_s3(spec),
        pause_shards=tuple(spec.get("pause_shards", ())),
        checked_before_commit=bool(spec.get("checked_before_commit")),
    )


def dispatched(committed: int, wall_s: float = 0.0):
    """What the driver's dispatch returns when the shards ran in this process: `committed` shards,
    no actor started (so the driver's fence has none to wait for)."""
    from ditfleet.driver.dispatch.types import DispatchResult, DispatchStats

    return DispatchResult([], [], DispatchStats(), wall_s, wall_s, wall_s, committed=committed, actors=[])


def in_process(todo, worker_cls, args, config, events, keep_results=False):
    """The driver's dispatch, in this process: each shard once, attempt 0, reported to the
    driver's dispatch events as an actor's would be (the driver's `after_dispatch_start` pause
    point is one of them)."""
    worker = worker_cls(*args)
    started = time.monotonic()
    for shard in todo:
        events.shard_started(shard, 0, worker.worker_id, False)
        events.shard_committed(shard, worker.run_shard(shard, 0))
    return dispatched(len(todo), time.monotonic() - started)


def run(spec: dict[str, Any]) -> int:
    import ditfleet.driver.run_job as run_job_module
    from tests.support.format_worker import FormatWorker

    run_job_module.run_shards = in_process
    summary = run_job_module.run_job(
        driver_config(spec),
        worker_config(spec),
        worker_cls=FormatWorker,
        stream=sys.stderr,
        interactive=False,
    )
    print(json.dumps({"status": summary.status, "exit_code": summary.exit_code}))
    return summary.exit_code


def worker(spec: dict[str, Any]) -> int:
    from ditfleet.driver.run_job import plan_input
    from tests.support.format_worker import FormatWorker

    plan = plan_input(driver_config(spec))
    shard = dataclasses.replace(plan.shards[int(spec["shard"])], generation=int(spec.get("generation", 0)))
    result = FormatWorker(worker_config(spec)).run_shard(shard, int(spec.get("attempt", 0)))
    print(json.dumps({"status": result.status, "token": result.attempt_token}))
    return 0


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    mode = spec.get("mode", "run")
    if mode == "cli":
        from ditfleet.jobs.cli import main as cli

        return cli(list(spec["argv"]))
    try:
        return run(spec) if mode == "run" else worker(spec)
    except Exception as e:  # noqa: BLE001 - the test reads what stopped the process
        print(f"ERROR {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
