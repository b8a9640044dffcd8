"""The fence before `_SUCCESS`: the driver waits until a killed actor's process is gone, not
only until Ray calls it dead."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ditfleet.driver.output.fence import process_gone, wait_actors_gone


def test_process_gone_sees_live_exited_and_zombie_processes():
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not process_gone(child.pid):  # exited but not reaped: a zombie, which cannot write
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.05)
    child.wait()
    assert process_gone(child.pid)


@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_actors_process_is_gone_when_the_fence_returns():
    import ray

    @ray.remote(num_cpus=0)
    class Uploader:
        def pid(self) -> int:
            return os.getpid()

        def upload_forever(self) -> None:
            while True:
                time.sleep(0.01)

    actors = [Uploader.remote() for _ in range(2)]
    pids = ray.get([a.pid.remote() for a in actors])
    for a in actors:
        a.upload_forever.remote()  # busy, as an actor in the middle of a shard
    # Not killed: the fence does not pass (it reports the actor) and does not hang.
    t0 = time.monotonic()
    assert wait_actors_gone(actors[:1], timeout_s=1.0) == [actors[0]._actor_id.hex()]
    assert time.monotonic() - t0 < 10
    for a in actors:
        ray.kill(a, no_restart=True)
    assert wait_actors_gone(actors, timeout_s=60) == []
    assert all(process_gone(p) for p in pids)
