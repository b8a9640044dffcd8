"""S3 fixtures: a moto server on 127.0.0.1 (port 0), talked to over HTTP by the real boto3.

- `s3_server` (session): the running server, fake credentials in this process's environment
  (boto3's default chain finds them; start Ray after this fixture if actors need them).
- `s3_bucket`: a fresh bucket per test; `s3_config`: an S3Config for the server.
- `fault_proxy`: a FaultProxy in front of the server (no faults until a plan is set).
- `s3_auth_enforced`: moto checks credentials for the duration of a test.
"""

from __future__ import annotations

import functools
import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ditfleet.workers.storage import S3Config
from tests.support.fault_proxy import FaultProxy

REGION = "us-east-1"
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    # No instance-metadata lookups (slow timeouts) when a test removes the credentials.
    "AWS_EC2_METADATA_DISABLED": "true",
}
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


@dataclass(frozen=True)
class MotoS3:
    """The running server. `admin` is a client for setting up and inspecting state directly
    (never through a proxy, never with a test's credentials)."""

    host: str
    port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def config(self, endpoint_url: str | None = None, **overrides: Any) -> S3Config:
        """An S3Config for this server (or for a proxy in front of it)."""
        return S3Config(
            endpoint_url=endpoint_url or self.endpoint_url,
            region=REGION,
            addressing_style="path",
            **overrides,
        )

    def client(self, endpoint_url: str | None = None, **overrides: Any) -> Any:
        """A new boto3 client from the default credential chain (as the stores make them)."""
        from ditfleet.workers.storage.s3 import make_s3_client

        return make_s3_client(self.config(endpoint_url, **overrides))

    @functools.cached_property
    def admin(self) -> Any:
        return self.client()

    def set_auth(self, initial_no_auth_action_count: float) -> float:
        """Moto's own switch: after this many more requests, credentials are checked."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset-auth",
            data=str(initial_no_auth_action_count).encode(),
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return float(json.loads(reply.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        for name in _UNSET:
            env.delenv(name, raising=False)
        for name, value in FAKE_CREDENTIALS.items():
            env.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield MotoS3(host, port)
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoS3) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.admin.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_config(s3_server: MotoS3) -> S3Config:
    return s3_server.config(max_attempts=3)


@pytest.fixture
def fault_proxy(s3_server: MotoS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.host, s3_server.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def s3_auth_enforced(s3_server: MotoS3) -> Iterator[None]:
    """Moto checks signatures and access keys while the test runs (create buckets before)."""
    previous = s3_server.set_auth(0)
    try:
        yield
    finally:
        s3_server.set_auth(previous)
