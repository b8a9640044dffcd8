"""Shared pytest set-up. Fixtures live in their own modules, registered here."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def _threads_per_worker() -> int:
    """Each pytest-xdist worker's share of the cores, at most 2 (the tests' tensors gain nothing
    from more). Two workers on 2 cores with 2 threads each oversubscribe them: OpenMP's threads then
    wait on each other, and a generation that takes 4 s alone took 20 s next to the other worker."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, cores // workers))


# Read by torch when it is imported, and inherited by the Ray cluster's workers and child processes.
# A count the caller set is kept; the one this file set in the xdist controller (whose environment
# the workers inherit, before they know their number) is worked out again in each worker.
_OWN_COUNT = "DITFLEET_TESTS_OMP_NUM_THREADS"
if os.environ.get("OMP_NUM_THREADS") in (None, os.environ.get(_OWN_COUNT)):
    os.environ["OMP_NUM_THREADS"] = os.environ[_OWN_COUNT] = str(_threads_per_worker())


def _share_kernel_builds_within_the_run() -> None:
    """Inductor's C++ kernels built once per test run, whichever test and process builds them
    (tests/support/cached-g++ says how and why). The folder is temporary and lives as long as the
    run; a CXX the caller set is kept. The xdist workers inherit what the controller sets."""
    if "CXX" in os.environ or "DITFLEET_TESTS_KERNEL_CACHE" in os.environ:
        return
    cache = tempfile.mkdtemp(prefix="ditfleet-tests-kernels-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ.update(
        CXX=str(Path(__file__).parent / "support" / "cached-g++"),
        DITFLEET_TESTS_KERNEL_CACHE=cache,
    )


def _trust_the_hosts_vector_isa() -> None:
    """Every process that compiles with Inductor on the CPU first proves which vector instruction
    set works (it builds a probe per candidate ISA, then loads each in a Python child): about 3 s a
    fresh process, and the tests start dozens. The run's processes share one host and one compiler,
    so they take the best ISA the host's /proc/cpuinfo lists, as the probe picks on this host. A
    value the caller set is kept."""
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


_share_kernel_builds_within_the_run()
_trust_the_hosts_vector_isa()

pytest_plugins = [
    "tests.support.fixtures_s3",
    "tests.support.fixtures_ray",
]


import pytest  # noqa: E402


def _made_once_per_run(tmp_path_factory, name: str, make):
    """`make(folder)` once for the whole test run, its result shared by the xdist workers: the first
    worker to ask makes it under the run's temp folder while holding a lock, the others wait and
    take the same result. The folders these make are only read by the tests. Without xdist, a
    folder of this session's own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    done = root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed making it left
            folder.mkdir()
            done.write_text(str(make(folder)))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A tiny random-weight Qwen-Image model in the diffusers layout, written by diffusers."""
    from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir

    return _made_once_per_run(
        tmp_path_factory, "random-model", lambda d: add_tiny_text_encoder(make_diffusers_model_dir(d))
    )


@pytest.fixture(scope="session")
def real_widths_dir(tmp_path_factory):
    """Qwen-Image's published layout cut to one block (hidden 3072, text 3584, the full VAE), random
    bf16 weights in four hub-style shards + index (ditfleet/testing/real_widths.py); about 1 GB on
    disk, written once per run."""
    from ditfleet.testing.real_widths import write_real_widths_checkpoint

    return _made_once_per_run(
        tmp_path_factory,
        "real-widths",
        lambda d: write_real_widths_checkpoint(d / "qwen-image", num_layers=1),
    )
