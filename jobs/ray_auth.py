"""Before a driver connects to (or submits to) a cluster: that something answers at the address
(`wait_for_cluster`, with a deadline), and Ray's token authentication.

`ray.init` at an address where nothing listens (a stopped head, a stale `ray_current_cluster`
file behind `--address auto`) retries with no end a user sees and lets ctrl-C through late;
`wait_for_cluster` opens the GCS port itself until a deadline, then raises `NoRayCluster`, which
the CLI turns into exit 2 with what to check.

A cluster started with `RAY_AUTH_MODE=token` (Ray turns it on by itself for `ray start --head`
once `~/.ray/auth_token` exists, which any local `ray.init` creates) refuses a client without
the token. `ray.init` then retries the GCS for about 20 s and ends in "Failed to connect to
Ray cluster", which names neither the token nor the setting; the job server raises a bare
`AuthenticationError`. Both become one `ClusterAuthError` that says what to set, found with one
gRPC call (no retries) before anything is written.
"""

from __future__ import annotations

import os
import socket
import sys
import time

PROBE_TIMEOUT_S = 10.0
CONNECT_DEADLINE_S = 30.0  # how long a cluster may take to answer (a head still starting)
_RETRY_S = 0.5
RAY_CLIENT_PORT = 10001  # ray://HEAD with no port


class NoRayCluster(ValueError):
    """Nothing answered at the cluster address before the deadline: a setting to check."""


def cluster_endpoint(address: str) -> tuple[str, int]:
    """The (host, port) a driver connects to for `address`: host:port (the GCS), ray://host[:port]
    (Ray Client), or auto (RAY_ADDRESS, else the last head this machine started, from Ray's
    ray_current_cluster file). NoRayCluster when auto finds none."""
    if address.startswith("ray://"):
        host, _, port = address.removeprefix("ray://").partition(":")
        return host, int(port or RAY_CLIENT_PORT)
    from ray._private.services import get_ray_address_from_environment

    try:
        resolved = get_ray_address_from_environment(address, None)
    except ConnectionError as e:  # auto, and no cluster recorded on this machine
        raise NoRayCluster(f"no Ray cluster at {address}: {e}") from None
    host, _, port = (resolved or "").rpartition(":")
    if not host or not port.isdigit():
        raise NoRayCluster(
            f"no Ray cluster at {address}: give HOST:PORT (the head's GCS port, 6379 by default)"
        )
    return host, int(port)


def wait_for_cluster(address: str, deadline_s: float = CONNECT_DEADLINE_S) -> None:
    """Return once something accepts a connection at `address`'s port; NoRayCluster after
    `deadline_s` seconds of refusals, one line a try on stderr after the first."""
    host, port = cluster_endpoint(address)
    end = time.monotonic() + deadline_s
    tries = 0
    while True:
        tries += 1
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, end - time.monotonic()))):
                return
        except OSError as e:
            left = end - time.monotonic()
            if left <= 0:
                raise NoRayCluster(_no_cluster(address, host, port, deadline_s, e)) from None
            if tries == 1:
                shown = address if address == f"{host}:{port}" else f"{address} ({host}:{port})"
                print(
                    f"ditfleet: waiting up to {deadline_s:g} s for the Ray cluster at {shown}",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(min(_RETRY_S * tries, 5.0, left))


def _no_cluster(address: str, host: str, port: int, deadline_s: float, error: OSError) -> str:
    where = f"{address} ({host}:{port})" if address != f"{host}:{port}" else address
    stale = (
        " With --address auto (or none), Ray took the address from the last head started on this "
        "machine (/tmp/ray/ray_current_cluster): a head stopped without `ray stop` leaves it behind; "
        "`ray stop` removes it, or name the address."
        if address == "auto"
        else ""
    )
    return (
        f"no Ray cluster at {where}: nothing answered for {deadline_s:g} s ({error.strerror or error}). "
        "Check that the head is running (`ray status --address HOST:PORT` on it) and that the address "
        "is its GCS port (6379 by default; ray://HEAD:10001 for Ray Client; not the dashboard's "
        f"http://HEAD:8265, which `ditfleet submit` takes).{stale} Nothing was written"
    )


class ClusterAuthError(ValueError):
    """The cluster wants Ray's authentication token and this process has none (or a wrong one):
    a setting to fix, not a failure to retry."""


def token_path() -> str:
    """Where Ray reads the token from: RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    return os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")


def refused(address: str) -> ClusterAuthError:
    """The one-line error for a cluster that refused this process's (missing or wrong) token."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        where = "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else token_path()
        return ClusterAuthError(
            f"the Ray cluster at {address} refused the authentication token in {where} "
            "(RAY_AUTH_MODE=token is set): put the cluster's own token there, then run the same "
            "command again; nothing was written"
        )
    return ClusterAuthError(
        f"the Ray cluster at {address} needs Ray's authentication token: set RAY_AUTH_MODE=token "
        f"and put the cluster's token in {token_path()} (or name its file in RAY_AUTH_TOKEN_PATH), "
        "then run the same command again; nothing was written"
    )


def check_gcs_token(address: str) -> None:
    """Raise ClusterAuthError when the GCS at `address` (host:port) refuses this process's token.

    One GetClusterId call with the metadata Ray itself would send. Anything but a refusal
    (unreachable, another kind of address) is left to `ray.init`, which says it better."""
    if not address or address == "auto" or "://" in address or ":" not in address:
        return
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(),  # type: ignore[attr-defined]  # generated protobuf
                timeout=PROBE_TIMEOUT_S,
                metadata=_get_authentication_metadata_tuple(),
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise refused(address) from None
