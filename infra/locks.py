"""The shard lock: a Redis lock with an expiry, extended by a heartbeat while it is held."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import LockError

from schemas.errors import TransientError

# How long a dead holder blocks the shard: the lock's expiry (a live holder extends it).
LOCK_TTL_S = float(os.environ.get("ROLLOUTS_LOCK_TTL_S", "30"))
ACQUIRE_TIMEOUT_S = 120.0
# Held for one storage write (milliseconds): a waiter that slept redis-py's default 100 ms would
# leave the shard idle most of the time when several processes take turns.
ACQUIRE_POLL_S = 0.005


@contextmanager
def held(
    r: redis.Redis,
    name: str,
    ttl_s: float = LOCK_TTL_S,
    acquire_timeout_s: float = ACQUIRE_TIMEOUT_S,
) -> Iterator[None]:
    """Hold lock `name`: it expires after `ttl_s` unless this process is alive to extend it.

    A holder that dies (SIGKILL) leaves the lock to expire, so the shard is never locked forever;
    a live holder with a slow write keeps it by the heartbeat.
    """
    lock = r.lock(
        name,
        timeout=ttl_s,
        sleep=ACQUIRE_POLL_S,
        blocking_timeout=acquire_timeout_s,
        thread_local=False,
    )
    if not lock.acquire():
        raise TransientError(f"could not acquire {name} within {acquire_timeout_s:.0f}s")
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                lock.reacquire()
            except (LockError, redis.RedisError):
                return

    beat = threading.Thread(target=heartbeat, name=f"heartbeat:{name}", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        # Expired or lost with Redis: nothing left to release.
        with contextlib.suppress(LockError, redis.RedisError):
            lock.release()
