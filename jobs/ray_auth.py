"""Ray's token authentication, checked before a driver connects to (or submits to) a cluster.

A cluster started with `RAY_AUTH_MODE=token` (Ray turns it on by itself for `ray start --head`
once `~/.ray/auth_token` exists, which any local `ray.init` creates) refuses a client without
the token. `ray.init` then retries the GCS for about 20 s and ends in "Failed to connect to
Ray cluster", which names neither the token nor the setting; the job server raises a bare
`AuthenticationError`. Both become one `ClusterAuthError` that says what to set, found with one
gRPC call (no retries) before anything is written.
"""

from __future__ import annotations

import os

PROBE_TIMEOUT_S = 10.0


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
