"""Unit tests start no Ray and no server: a test that needs a Ray cluster or an S3 endpoint lives in
tests/integration/, so that the unit suite stays fast and runs anywhere.

Held two ways:
- a unit test fails if it asks for a fixture of tests/support/fixtures_ray.py or fixtures_s3.py
  (a Ray cluster, a moto server, a bucket on it, a fault proxy in front of it), directly, through
  another fixture or with `request.getfixturevalue`, before that fixture starts anything;
- while it runs, listening on a TCP socket (any in-process server: moto, http.server, a proxy)
  raises, and `ray.init` raises; a test that imported Ray itself and left it running fails
  afterwards.
"""

from __future__ import annotations

import socket
import sys

import pytest

# The plugins whose fixtures start a server or a Ray cluster (registered in tests/conftest.py).
SERVER_FIXTURE_MODULES = frozenset({"tests.support.fixtures_ray", "tests.support.fixtures_s3"})
ROOMS = "unit tests start no Ray and no server; move this test to tests/integration/ (tests/unit/conftest.py)"


class StartsAServer(RuntimeError):
    """A unit test started, or asked for, a server or a Ray cluster."""


def server_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures `item` needs (its whole closure) that start a server or a Ray cluster."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(
        name
        for name, defs in info.name2fixturedefs.items()
        if any(getattr(d.func, "__module__", None) in SERVER_FIXTURE_MODULES for d in defs)
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Runs before the item's fixtures are set up, so a refused fixture never starts.
    found = server_fixtures(item)
    if found:
        pytest.fail(f"{item.nodeid} uses {', '.join(found)}: {ROOMS}", pytrace=False)


_getfixturevalue = pytest.FixtureRequest.getfixturevalue


def _refuse_server_fixture_values(self: pytest.FixtureRequest, argname: str):
    # The same fixtures asked for while the test runs, before they start: a moto server started
    # under the listen guard would fail in its own thread and leave the test waiting for it.
    defs = self._fixturemanager.getfixturedefs(argname, self._pyfuncitem) or ()
    if any(getattr(d.func, "__module__", None) in SERVER_FIXTURE_MODULES for d in defs):
        pytest.fail(f"{self._pyfuncitem.nodeid} asked for {argname}: {ROOMS}", pytrace=False)
    return _getfixturevalue(self, argname)


_listen = socket.socket.listen


def _refuse_tcp_listen(self: socket.socket, *args, **kwargs):
    # Unix sockets stay allowed: multiprocessing's forkserver and managers listen on them locally.
    if self.family in (socket.AF_INET, socket.AF_INET6):
        raise StartsAServer(f"a unit test listened on a TCP socket: {ROOMS}")
    return _listen(self, *args, **kwargs)


def _refuse_ray_init(*args, **kwargs):
    raise StartsAServer(f"a unit test called ray.init: {ROOMS}")


@pytest.fixture(autouse=True)
def _no_server_and_no_ray(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(socket.socket, "listen", _refuse_tcp_listen)
    monkeypatch.setattr(pytest.FixtureRequest, "getfixturevalue", _refuse_server_fixture_values)
    ray = sys.modules.get("ray")
    # In one pytest run over tests/ the integration tests' session cluster is up (they run first):
    # that one is not this test's to stop or blame.
    up_before = ray is not None and ray.is_initialized()
    if ray is not None:
        monkeypatch.setattr(ray, "init", _refuse_ray_init)
    yield
    # Ray imported during the test (after the patch above could apply) and started anyway.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not up_before:
        ray.shutdown()
        pytest.fail(f"a unit test started Ray: {ROOMS}", pytrace=False)
