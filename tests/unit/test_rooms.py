"""The guard of tests/unit/conftest.py: a unit test cannot start a server or ask for one."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from tests.unit.conftest import StartsAServer, server_fixtures


def test_listening_on_tcp_is_refused_and_unix_sockets_still_work(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.bind(("127.0.0.1", 0))
        with pytest.raises(StartsAServer, match="tests/integration"):
            tcp.listen()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.bind(str(tmp_path / "sock"))
        unix.listen()


def test_the_server_and_ray_fixtures_are_found_in_a_closure(request):
    assert server_fixtures(request.node) == []
    manager = request._fixturemanager
    closure = {
        name: manager.getfixturedefs(name, request.node) for name in ("s3_bucket", "ray_cluster", "tmp_path")
    }
    item = SimpleNamespace(_fixtureinfo=SimpleNamespace(name2fixturedefs=closure))
    assert server_fixtures(item) == ["ray_cluster", "s3_bucket"]
