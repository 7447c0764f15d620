"""The HTTP side of a worker process: one event loop thread and one pooled httpx client.

Celery runs each rollout task in a pool thread; the thread hands its `/run` call to this loop and
waits. Hundreds of calls then share one loop and one connection pool instead of one blocking
client per thread, and a call's time limit is an asyncio timeout, so it never kills the worker.
A process builds these lazily and again after a fork (each process owns its own sockets).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
# httpx's pool does work proportional to its size on every request; several small pools keep
# that cost flat when hundreds of calls are in flight at once.
CLIENT_SHARDS = 8


class EventLoopThread:
    """An asyncio event loop running forever in a daemon thread."""

    def __init__(self, name: str = "rollouts-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()


class HttpPool:
    """Pooled async httpx clients living on one event loop; use only from that loop."""

    def __init__(self, shards: int = CLIENT_SHARDS) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        self._clients = [httpx.AsyncClient(limits=limits, timeout=timeout) for _ in range(shards)]
        self._next = itertools.cycle(self._clients)

    def client(self) -> httpx.AsyncClient:
        return next(self._next)

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()


class _ProcessIO:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = EventLoopThread()
        self.http: HttpPool = self.loop.run(_make_pool())


async def _make_pool() -> HttpPool:
    return HttpPool()


_io: _ProcessIO | None = None
_io_lock = threading.Lock()


def process_io() -> _ProcessIO:
    """This process's event loop thread and HTTP pool, created on first use."""
    global _io
    io = _io
    if io is not None and io.pid == os.getpid():
        return io
    with _io_lock:
        if _io is None or _io.pid != os.getpid():
            _io = _ProcessIO()
        return _io
