"""One Redis client per process and URL, rebuilt after a fork."""

from __future__ import annotations

import redis

from infra.process import PerProcess


def _connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        max_connections=4096,
        health_check_interval=30,
        socket_keepalive=True,
        retry_on_timeout=True,
    )


_clients: PerProcess[str, redis.Redis] = PerProcess(_connect)


def client(url: str) -> redis.Redis:
    """A shared client for `url` in this process (connection pool sized for many threads)."""
    return _clients.get(url)
