"""Node loss: a worker node with an actor on it disappears mid-job (every process of the node
killed at once, as when a cloud node goes away). The job still ends with every row exactly
once, `ditfleet verify` clean, and the weights (on S3) fetched once per node.

The cluster (three nodes on 127.0.0.1: a head without CPUs, two one-CPU worker nodes) runs in a
child process (tests/support/node_loss_child.py), so the session's Ray is not touched.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.fixtures_ray import run_own_cluster
from tests.support.fixtures_s3 import FAKE_CREDENTIALS, REGION
from tests.support.paths import REPO
from tests.support.worker_fixtures import write_prompts

ROWS, SHARD_SIZE = 16, 2
ROOT = REPO


def _stage_model(s3_server, bucket: str, model_dir: Path) -> str:
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            rel = path.relative_to(model_dir).as_posix()
            s3_server.admin.put_object(Bucket=bucket, Key=f"models/tiny/{rel}", Body=path.read_bytes())
    return f"s3://{bucket}/models/tiny"


@pytest.mark.slow
def test_losing_a_node_mid_job_loses_and_duplicates_nothing(random_model_dir, s3_server, s3_bucket, tmp_path):
    spec = {
        "prompts": str(write_prompts(tmp_path / "prompts.parquet", ROWS)),
        "output": f"s3://{s3_bucket}/out",
        "model": _stage_model(s3_server, s3_bucket, random_model_dir),
        "cache_dir": str(tmp_path / "model-cache"),
        "endpoint_url": s3_server.endpoint_url,
        "region": REGION,
        "shard_size": SHARD_SIZE,
        "result": str(tmp_path / "result.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, **FAKE_CREDENTIALS, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.support.node_loss_child", str(tmp_path / "spec.json")]
    returncode, _, err = run_own_cluster(cmd, ROOT, env, timeout_s=240)
    assert returncode == 0, err[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    summary, verify, removed = result["summary"], result["verify"], result["removed"]

    # A node with a running actor was removed after the first commit, before the last one.
    assert removed.get("node_id"), result["log"]
    assert 1 <= removed["committed_before"] < ROWS // SHARD_SIZE
    # Its actor's shards were run again elsewhere: requeued when Ray reported the actor dead, or
    # (often first, since Ray notices a lost node only after its health checks fail) moved or
    # duplicated onto the surviving actor by the tail logic.
    d = summary["dispatch"]
    assert d["actor_deaths"] + d["retries"] + d["tail_moves"] + d["speculative_runs"] >= 1, (
        d,
        removed,
        result["log"],
    )
    # 0 rows lost, 0 duplicated: every shard committed once, every row once, every sha256 right.
    assert summary["status"] == "succeeded", result["log"]
    assert summary["shards"] == {**summary["shards"], "planned": ROWS // SHARD_SIZE, "left": 0, "failed": 0}
    assert summary["rows"] == {"planned": ROWS, "ok": ROWS, "failed": 0}
    assert verify["ok"] and verify["complete"] and not verify["problems"], result["verify_text"]
    assert verify["rows"] == ROWS and verify["images"] == {"ok": ROWS, "failed": 0}
    assert verify["objects_checked"] == ROWS and verify["orphans"] == 0, result["verify_text"]
    # The fence before _SUCCESS confirmed every actor's process gone, the lost node's included.
    assert "still had a live process" not in result["log"], result["log"]
    # Weights: downloaded once into the node cache; every other actor found them there. (The
    # nodes of this test share one disk, so "once per node" is once here.)
    fetches = [w["model_fetch"] for w in summary["startup"]["per_worker"].values()]
    assert len(fetches) >= 2
    assert sum(1 for f in fetches if f["fetched"]) == 1, fetches
