"""One Redis client per process and URL, rebuilt after a fork; connections bounded and released
when idle.

A worker's threads share a few connections: each Redis call holds one for well under a
millisecond, so `ROLLOUTS_REDIS_MAX_CONNECTIONS` (default 64) serves hundreds of threads, and a
thread that finds them all busy waits for one (up to `POOL_TIMEOUT_S`) instead of opening
another. A pool nobody used for `ROLLOUTS_REDIS_IDLE_S` (default 60 s) closes its free
connections; the next call opens one again. The Celery result backend of a worker uses the same
kind of pool (`workers/app.py`), so a worker between runs holds only its broker connections.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import redis

from infra.environment import from_env
from infra.process import PerProcess

POOL_TIMEOUT_S = 30.0
"""How long a call waits for a free connection before it fails as a connection error."""


class IdleReleasingPool(redis.BlockingConnectionPool):
    """A bounded, blocking pool that knows when it was last used."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_connections", from_env().redis_max_connections)
        kwargs.setdefault("timeout", POOL_TIMEOUT_S)
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.last_used = time.monotonic()
        _reaper.get(None).watch(self)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.last_used = time.monotonic()
        return super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    def open_connections(self) -> int:
        """Connections with a socket open, free or in use."""
        with self._lock:
            return sum(1 for c in self._connections if getattr(c, "_sock", None) is not None)

    def release_if_idle(self, idle_s: float, now: float) -> None:
        """Close the free connections if nothing took one for `idle_s`."""
        if now - self.last_used >= idle_s:
            self.disconnect(inuse_connections=False)


class _Reaper:
    """One daemon thread per process closing the free connections of idle pools."""

    def __init__(self, _key: None) -> None:
        self.idle_s = from_env().redis_idle_s
        self._pools: weakref.WeakSet[IdleReleasingPool] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rollouts-redis-idle", daemon=True)
        self._thread.start()

    def watch(self, pool: IdleReleasingPool) -> None:
        with self._lock:
            self._pools.add(pool)

    def _loop(self) -> None:
        while True:
            time.sleep(max(0.5, self.idle_s / 4))
            with self._lock:
                pools = list(self._pools)
            now = time.monotonic()
            for pool in pools:
                pool.release_if_idle(self.idle_s, now)


_reaper: PerProcess[None, _Reaper] = PerProcess(_Reaper)


def _no_factory(key: str) -> IdleReleasingPool:
    raise AssertionError(f"shared_pool makes its pools ({key})")


_pools: PerProcess[str, IdleReleasingPool] = PerProcess(_no_factory)


def shared_pool(**params: Any) -> IdleReleasingPool:
    """This process's one pool for these connection parameters. Celery's result backend makes a
    backend per thread, each asking for a pool with equal parameters (and its own `driver_info`
    object): they all get this one."""
    key = repr(sorted((k, repr(v)) for k, v in params.items()))
    return _pools.get(key, lambda: IdleReleasingPool(**params))


def _connect(url: str) -> redis.Redis:
    pool = IdleReleasingPool.from_url(
        url, health_check_interval=30, socket_keepalive=True, retry_on_timeout=True
    )
    return redis.Redis(connection_pool=pool)


_clients: PerProcess[str, redis.Redis] = PerProcess(_connect)


def client(url: str) -> redis.Redis:
    """A shared client for `url` in this process (a bounded pool shared by its threads)."""
    return _clients.get(url)


def run_scripts(
    r: redis.Redis, script: Any, prepared: list[tuple[list[str], list[Any]]]
) -> list[Any]:
    """`script` (a registered `redis.commands.core.Script`) once per (keys, args) of `prepared`,
    by its digest, in one pipeline (not a transaction: each script is atomic on its own): each
    call's answer, or its error, in its place. Those Redis did not know the script for (it
    restarted) did not run: they are sent again once it is loaded. A connection error raises
    for all."""
    answers: list[Any] = [None] * len(prepared)
    todo = list(range(len(prepared)))
    for _ in range(2):
        pipe = r.pipeline(transaction=False)
        for i in todo:
            names, args = prepared[i]
            pipe.evalsha(script.sha, len(names), *names, *args)
        for i, answer in zip(todo, pipe.execute(raise_on_error=False), strict=True):
            answers[i] = answer
        todo = [i for i in todo if isinstance(answers[i], redis.exceptions.NoScriptError)]
        if not todo:
            break
        r.script_load(script.script)
    return answers
