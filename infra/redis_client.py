"""One Redis client per process and URL, rebuilt after a fork."""

from __future__ import annotations

import os
import threading

import redis

_lock = threading.Lock()
_clients: dict[tuple[int, str], redis.Redis] = {}


def client(url: str) -> redis.Redis:
    """A shared client for `url` in this process (connection pool sized for many threads)."""
    key = (os.getpid(), url)
    found = _clients.get(key)
    if found is not None:
        return found
    with _lock:
        found = _clients.get(key)
        if found is None:
            found = redis.Redis.from_url(
                url,
                max_connections=4096,
                health_check_interval=30,
                socket_keepalive=True,
                retry_on_timeout=True,
            )
            _clients[key] = found
        return found
