"""An actor's start-up phase, published where the driver can read it while `__init__` runs.

A Ray actor answers no method call until its constructor returns, and the constructor is where
the worker loads weights and compiles: minutes on a cold machine. So the worker writes its phase
(loading, compiling bucket i of n, ready) to Ray's key-value store in the GCS, keyed by its actor
id, and the driver polls it (driver.actor_phases). One small write per phase change; nothing is
written outside Ray (the job's output stays untouched until a shard commits).

Publishing is informational: any failure to write is ignored, and outside a Ray actor it is a
no-op, so the worker behaves the same in tests that build it directly.
"""

from __future__ import annotations

import json
from typing import Any

NAMESPACE = "ditfleet_startup_phase"
LOADING = "loading"  # placed; fetching and loading weights
COMPILING = "compiling"  # compiling / warming up bucket i of n
READY = "ready"  # constructor done; the start-up report is on its way to the driver
PHASES = (LOADING, COMPILING, READY)


def phase_key(actor_id: str) -> bytes:
    return f"actor:{actor_id}".encode()


def _kv():
    """Ray's GCS key-value client of this process.

    Something in the process can drop it while Ray stays connected (`ray.cluster_utils.Cluster.
    shutdown()` resets it for every cluster, its own or not); then it is re-attached to the
    connected worker's GCS client instead of every read failing for the rest of the process.
    """
    import ray
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized() and ray.is_initialized():
        internal_kv._initialize_internal_kv(ray._private.worker.global_worker.gcs_client)
    return internal_kv


def current_actor_id() -> str | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_actor_id() or None
    except Exception:  # noqa: BLE001 - outside an actor there is nobody to report to
        return None


def publish_phase(phase: str, **detail: Any) -> None:
    """Say which start-up phase this actor is in (detail: bucket=i, buckets=n, name='WxH')."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r}; one of {PHASES}")
    actor_id = current_actor_id()
    if actor_id is None:
        return
    try:
        _kv()._internal_kv_put(
            phase_key(actor_id),
            json.dumps({"phase": phase, **detail}).encode(),
            overwrite=True,
            namespace=NAMESPACE,
        )
    except Exception:  # noqa: BLE001 - progress display only; never fail a start-up over it
        return


def read_phase(actor_id: str) -> dict | None:
    """The phase an actor last published (None: nothing yet, or the store is unreachable)."""
    try:
        raw = _kv()._internal_kv_get(phase_key(actor_id), namespace=NAMESPACE)
        value = json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001 - unknown phase; the caller shows what Ray says instead
        return None
    return value if isinstance(value, dict) and value.get("phase") in PHASES else None


def forget_phase(actor_id: str) -> None:
    """Drop an actor's phase once it is ready or gone (keeps the GCS store small)."""
    try:
        _kv()._internal_kv_del(phase_key(actor_id), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - a stale key is harmless; it names a dead actor
        return
