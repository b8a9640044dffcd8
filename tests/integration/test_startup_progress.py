"""Progress during actor start-up says where each actor is, on the session's real Ray cluster.

An actor asking for a GPU on the CPU-only test cluster is reported as unplaceable (Ray keeps it
pending and no node has a GPU); an actor that is placed but slow to warm up is reported as
loading, then compiling bucket i of n, and never as waiting for resources.

No check depends on how fast the machine runs: the slow actor stays in each phase until the
driver's progress has shown it (the test's stream drops a file per phase seen), and in its last
one until the time shown in it has counted up to 1 s.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest

from ditfleet.driver.dispatch import DispatchConfig, DispatchError, run_shards
from ditfleet.driver.progress import JobProgress
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.startup_phase import COMPILING, LOADING, READY, publish_phase
from tests.support.dispatch_workers import SleepingWorker, SleepingWorkerConfig

pytestmark = pytest.mark.usefixtures("ray_cluster")


# What the driver's progress must have shown before the slow actor leaves each phase.
SHOWN = (
    r"1 loading weights",
    r"1 compiling bucket 1/2 \(64x64\)",
    r"1 compiling bucket 2/2 \(128x128\) [1-9]\d*s",  # the time in the phase counted up
)


class SlowWarmupWorker(SleepingWorker):
    """Publishes its start-up phases like workers.actor.GenerationWorker, and leaves phase i only
    once the file `gates/i` exists (or after a minute, so a progress that never shows the phase
    fails the test's checks, not its time limit)."""

    def __init__(self, config: SleepingWorkerConfig, gates: str, buckets: int) -> None:
        phases = [(LOADING, {})]
        phases += [
            (COMPILING, dict(bucket=i, buckets=buckets, name=f"{64 * i}x{64 * i}"))
            for i in range(1, buckets + 1)
        ]
        for i, (phase, fields) in enumerate(phases):
            publish_phase(phase, **fields)
            deadline = time.monotonic() + 60
            while not (Path(gates) / str(i)).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        super().__init__(config)
        publish_phase(READY)


class GatingStream(io.StringIO):
    """The progress stream: once the text holds `SHOWN[i]`, it drops the file `gates/i`."""

    def __init__(self, gates: Path) -> None:
        super().__init__()
        self.gates = gates
        gates.mkdir()

    def write(self, text: str) -> int:
        n = super().write(text)
        for i, pattern in enumerate(SHOWN):
            gate = self.gates / str(i)
            if not gate.exists() and re.search(pattern, self.getvalue()):
                gate.touch()
        return n


def shards(n: int) -> list[ShardSpec]:
    return [ShardSpec(i, "memory://prompts", i, i + 1, i, ("64x64",), 1) for i in range(n)]


def progress(stream: io.StringIO) -> JobProgress:
    # Non-interactive: a status line every 0.5 s, and the start-up notice after 1 s of waiting.
    return JobProgress(2, 2, stream=stream, interactive=False, status_every_s=0.5, startup_notice_s=1.0)


def test_unplaceable_actor_is_reported_as_such(tmp_path):
    out = io.StringIO()
    config = DispatchConfig(
        min_actors=1, max_actors=1, num_cpus=0.5, num_gpus=1, placement_timeout_s=4.0, tick_s=0.1
    )
    worker = SleepingWorkerConfig(output_uri=str(tmp_path / "out"))
    with pytest.raises(DispatchError, match="no worker actor became ready"):
        run_shards(shards(2), SleepingWorker, (worker,), config, progress(out))
    text = out.getvalue()
    assert "1 actor cannot be placed: each asks for 0.5 CPU, 1 GPU; no node has that much" in text, text
    assert "1 unplaceable" in text, text  # the bar's actor part names the phase too
    assert "loading weights" not in text and "compiling" not in text


def test_slow_warmup_is_reported_as_loading_then_compiling(tmp_path):
    # A `ray.cluster_utils.Cluster` shut down anywhere in the process resets this process's GCS
    # key-value client although Ray stays connected (other tests of the session do that); the
    # phases must still be read.
    from ray.experimental import internal_kv

    internal_kv._internal_kv_reset()
    out = GatingStream(tmp_path / "gates")
    config = DispatchConfig(min_actors=1, max_actors=1, num_cpus=0.5, tick_s=0.1)
    worker = SleepingWorkerConfig(output_uri=str(tmp_path / "out"), shard_s=0.01)
    result = run_shards(shards(2), SlowWarmupWorker, (worker, str(out.gates), 2), config, progress(out))
    assert len(result.results) == 2 and not result.failed
    text = out.getvalue()
    for pattern in SHOWN:  # loading, then each bucket, and the time in a phase counting up
        assert re.search(pattern, text), (pattern, text)
    assert "no worker actor ready after" in text, text
    # Placed all along: nothing may blame the cluster's resources.
    assert "no free resources" not in text and "cannot be placed" not in text, text
