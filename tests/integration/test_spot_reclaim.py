"""Spot reclaim with the real worker on a real local Ray: SIGTERM to an actor's process while it
generates a shard. The shard is given up uncommitted (no manifest from that process, no partial
object), the actor exits, the driver requeues the shard without counting a failed attempt, and
the job completes with every row exactly once."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, run_job
from ditfleet.workers.output.formats.files import OBJECTS as IMAGES
from ditfleet.workers.output.layout import MANIFESTS_PREFIX, manifest_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from tests.support.worker_fixtures import row_config, worker_config, write_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: it no longer runs.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _sigterm_mid_shard(out: Path, found: dict, deadline_s: float = 240) -> None:
    """Once shard 0 is committed (its manifest names the actor's pid), wait until that actor
    has stored images of a later shard that is not committed, and SIGTERM it."""
    store = open_store(str(out))
    deadline = time.monotonic() + deadline_s
    pid = None
    while time.monotonic() < deadline:
        if pid is None and store.exists(manifest_key(0)):
            table = read_parquet(store.get(manifest_key(0)), ["worker"])
            pid = int(table.column("worker")[0].as_py().split(":")[1])  # host:pid:actor
        if pid is not None:
            committed = {k for k in store.list(MANIFESTS_PREFIX)}
            for key in store.list(IMAGES.area):
                shard = int(key.split("/")[1])
                if shard > 0 and manifest_key(shard) not in committed:
                    os.kill(pid, signal.SIGTERM)
                    found.update(
                        pid=pid,
                        shard=shard,
                        images_before=len(list(store.list(IMAGES.prefix(shard)))),
                    )
                    return
        time.sleep(0.02)


def test_sigterm_mid_shard_abandons_it_and_the_job_completes(random_model_dir, tmp_path: Path):
    prompts = write_prompts(tmp_path / "prompts.parquet", 40, row_group_size=10)
    out = tmp_path / "out"
    rows = row_config(steps=10)
    driver = DriverConfig(
        input_uri=str(prompts),
        output_uri=str(out),
        plan=PlanConfig(rows=rows, shard_size=10),
        dispatch=DispatchConfig(min_actors=1, max_actors=1, num_cpus=1, max_attempts=1, tick_s=0.1),
    )
    # batch 2: the stop request is seen within one small batch.
    worker = worker_config(random_model_dir, str(out), rows=rows, batch_size=2)
    found: dict = {}
    killer = threading.Thread(target=_sigterm_mid_shard, args=(out, found), daemon=True)
    killer.start()
    log = io.StringIO()
    summary = run_job(driver, worker, stream=log, interactive=False)
    killer.join(timeout=10)
    text = log.getvalue()
    assert found, "no shard was caught mid-way"
    # max_attempts=1: had the abandoned run counted as a failed attempt, the shard would have failed.
    assert summary.status == "succeeded" and summary.exit_code == 0, text
    assert "lost (stopping)" in text and "asked to stop" in text, text
    assert summary.dispatch["retries"] == 0 and summary.dispatch["actors_started"] == 2

    deadline = time.monotonic() + 30
    while _alive(found["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(found["pid"]), "the actor that got SIGTERM did not exit"

    store = open_store(str(out))
    table = read_manifests(store)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == [f"p{i:05d}" for i in range(40)], "every row exactly once"
    by_shard = {r["shard"]: r for r in table.select(["shard", "worker", "attempt"]).to_pylist()}
    interrupted = by_shard[found["shard"]]
    assert f":{found['pid']}:" not in interrupted["worker"], "the interrupted run committed nothing"
    assert interrupted["attempt"] == 1  # the rerun of the abandoned attempt 0
    root = store.uri()
    for row in table.select(["uri", "sha256", "bytes"]).to_pylist():  # no partial objects
        data = store.get(row["uri"][len(root) :].lstrip("/"))
        assert hashlib.sha256(data).hexdigest() == row["sha256"] and len(data) == row["bytes"]
