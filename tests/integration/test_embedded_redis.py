"""The embedded Redis of a local run: loopback only, a random password kept off the command line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from infra.embedded import EmbeddedRedis

pytestmark = pytest.mark.integration


def test_a_local_runs_redis_asks_for_a_password_that_ps_does_not_show() -> None:
    with EmbeddedRedis() as server:
        assert server.password and server.password in server.url
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert server.pid is not None
        argv = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in argv
        assert server.config_path.stat().st_mode & 0o077 == 0  # only its owner reads it
        # Loopback only: the port is not open on the machine's other addresses.
        addresses = {
            a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        }
        for address in addresses - {"127.0.0.1"}:
            with socket.socket() as s:
                s.settimeout(1)
                assert s.connect_ex((address, server.port)) != 0


def test_its_password_survives_a_restart_that_loses_its_data() -> None:
    with EmbeddedRedis() as server:
        redis.Redis.from_url(server.url).set("k", "v")
        server.restart_empty()
        r = redis.Redis.from_url(server.url)
        assert r.ping() and r.get("k") is None


def test_it_takes_as_many_clients_as_it_is_given() -> None:
    # The benchmark's sleeping chord opens a connection per thread: 16,384 at inflight-16k.
    with EmbeddedRedis() as default, EmbeddedRedis(maxclients=12_000) as larger:
        assert redis.Redis.from_url(default.url).config_get("maxclients")["maxclients"] == "10000"
        assert redis.Redis.from_url(larger.url).config_get("maxclients")["maxclients"] == "12000"
