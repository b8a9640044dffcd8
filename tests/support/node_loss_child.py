"""A job on a three-node local Ray (every node on 127.0.0.1) that loses a worker node mid-job.

Run by tests/integration/test_node_loss.py in its own process (the test session's Ray stays untouched):

    python -m tests.support.node_loss_child SPEC.json

SPEC: {"prompts", "output", "model", "cache_dir", "endpoint_url", "region", "shard_size",
"result"}.
The head has no CPUs (the driver only); two worker nodes have one CPU each, so the two actors
land one per node. When the first shard is committed, the node of an actor that is running a
shard is removed, all its processes killed at once. The driver carries on; at the end the
output is verified. Writes JSON to SPEC's "result": the summary, the verify report, the node
removed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import sys
import threading
import time

from tests.support.fixtures_ray import LOOPBACK, LOOPBACK_ENV
from tests.support.fixtures_s3 import FAKE_CREDENTIALS

_MiB = 1024 * 1024


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ.update(LOOPBACK_ENV)
    os.environ.update(FAKE_CREDENTIALS)
    import ray
    from ray.cluster_utils import Cluster

    from ditfleet.driver.dispatch import DispatchConfig
    from ditfleet.driver.output.verify import verify_output
    from ditfleet.driver.plan import PlanConfig
    from ditfleet.driver.run_job import DriverConfig, run_job
    from ditfleet.workers.output.layout import MANIFESTS_PREFIX
    from ditfleet.workers.storage import S3Config, open_store
    from tests.support.worker_fixtures import row_config, worker_config

    s3 = S3Config(endpoint_url=spec["endpoint_url"], region=spec["region"], addressing_style="path")
    node_args = {"node_ip_address": LOOPBACK, "object_store_memory": 80 * _MiB}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node_args,
            "num_cpus": 0,
            "include_dashboard": False,
            # Notice a lost node in ~3 s rather than the default ~30 s.
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    workers = [cluster.add_node(num_cpus=1, **node_args) for _ in range(2)]
    removed: dict[str, object] = {}
    try:
        ray.init(
            address=cluster.address, runtime_env={"env_vars": dict(FAKE_CREDENTIALS)}, logging_level="ERROR"
        )
        store = open_store(spec["output"], s3)

        def remove_a_busy_node() -> None:
            from ray._private import state

            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(True for _ in store.list(MANIFESTS_PREFIX)):
                time.sleep(0.05)
            pids: dict[str, list[int]] = {}  # node id -> pids of its live worker actors
            for a in state.actors().values():
                if a.get("State") == "ALIVE" and a.get("ActorClassName") == "GenerationWorker":
                    pids.setdefault((a.get("Address") or {}).get("NodeID"), []).append(int(a.get("Pid") or 0))
            for node in workers:
                if node.node_id in pids:
                    removed["node_id"] = node.node_id
                    removed["committed_before"] = sum(1 for _ in store.list(MANIFESTS_PREFIX))
                    # A lost machine takes every process with it at once. Removing the node kills its
                    # raylet, but an actor process would notice that only later and could finish its
                    # queued shards first: kill the actors' processes too.
                    for pid in pids[node.node_id]:
                        if pid > 0:
                            os.kill(pid, signal.SIGKILL)
                    cluster.remove_node(node, allow_graceful=False)
                    removed["at"] = time.time()
                    return

        killer = threading.Thread(target=remove_a_busy_node, daemon=True)
        rows = row_config(steps=60)  # the planner and the workers read rows the same way
        config = DriverConfig(
            input_uri=spec["prompts"],
            output_uri=spec["output"],
            # Steps enough that a shard (2 images of the tiny random model, ~10 ms a step) outlasts
            # the killer's reaction: the node it removes after the first commit still has work. With
            # a few steps a shard took 0.1 s, the whole job under a second, and the removed actor had
            # often finished its shards already (nothing to recover, nothing tested).
            plan=PlanConfig(rows=rows, shard_size=spec["shard_size"]),
            dispatch=DispatchConfig(
                min_actors=2, max_actors=2, num_cpus=1, placement_timeout_s=120, tick_s=0.2
            ),
            s3=s3,
            status_every_s=3600,
        )
        worker = dataclasses.replace(
            worker_config(spec["model"], spec["output"], s3=s3, rows=rows), model_cache_dir=spec["cache_dir"]
        )
        killer.start()
        log = io.StringIO()
        summary = run_job(config, worker, stream=log, interactive=False)
        killer.join(5)
        report = verify_output(store)
        with open(spec["result"], "w") as f:
            f.write(
                json.dumps(
                    {
                        "summary": summary.to_dict(),
                        "verify": report.to_dict(),
                        "verify_text": report.format_text(),
                        "removed": removed,
                        "log": log.getvalue()[-4000:],
                    },
                    default=str,
                )
            )
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
