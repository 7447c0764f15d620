"""The HTTP side of a worker process: one event loop thread and one pooled HTTP client.

Celery runs each rollout task in a pool thread; the thread hands its `/run` call to this loop and
waits. Hundreds of calls then share one loop and one connection pool instead of one blocking
client per thread, and a call's time limit is an asyncio timeout, so it never kills the worker.
A process builds these lazily and again after a fork (each process owns its own sockets).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import aiohttp
import httpx

from infra.process import PerProcess

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
HEARTBEAT_S: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "rollouts_http_heartbeat_s", default=None
)
"""Set around a request (`heartbeat`): write CRLF on its connection this often until the reply
begins. Read by `AiohttpClient`'s responses; other clients ignore it."""
HEARTBEAT = b"\r\n"


@contextlib.contextmanager
def heartbeat(every_s: float | None) -> Iterator[None]:
    """Requests sent inside this block keep their connection busy while they wait for a reply."""
    token = HEARTBEAT_S.set(every_s)
    try:
        yield
    finally:
        HEARTBEAT_S.reset(token)


class HeartbeatResponse(aiohttp.ClientResponse):
    """A response that, while its status line has not arrived, writes an empty line (CRLF) on its
    connection every `HEARTBEAT_S` seconds once the request is sent.

    An intermediary that closes connections idle for a fixed time (a cloud load balancer's 340 s)
    would otherwise cut a `/run` that produces no byte for longer. HTTP/1.1 servers ignore empty
    lines before a request line (RFC 9112, section 2.2), which is what these bytes are to them:
    the request before them is complete. The beat stops before the reply's head is handed over, so
    it never runs while the connection could carry another request.
    """

    async def start(self, connection: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        every = HEARTBEAT_S.get()
        if not every:
            return await super().start(connection)
        beat = asyncio.ensure_future(self._beat(connection, every))
        try:
            return await super().start(connection)
        finally:
            beat.cancel()

    async def _beat(self, connection: aiohttp.connector.Connection, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            # The request's body is written by a task of its own: an empty line in the middle of
            # it would corrupt it. (`_writer` is aiohttp's handle on that task; None once done.)
            if self._writer is not None:
                continue
            transport = connection.transport
            if transport is None or transport.is_closing():
                return
            transport.write(HEARTBEAT)


class StreamedReply(Protocol):
    """An HTTP reply whose body is read in chunks (decompressed), as `/run` callers read it."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...


class PostClient(Protocol):
    """What `/run` callers need of a client: `AiohttpClient` here, an `httpx.AsyncClient` (over
    `httpx.MockTransport`) in unit tests. Neither follows redirects."""

    def stream(
        self, method: str, url: str, *, content: bytes, headers: dict[str, str]
    ) -> contextlib.AbstractAsyncContextManager[StreamedReply]: ...


class AiohttpReply:
    """An aiohttp response seen through `StreamedReply`; its chunks are decompressed bytes."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        # aiohttp decompresses in bounded steps and stops reading the socket while its buffer is
        # full, so a reader that stops early never holds more than it took (gzip bombs included).
        async for chunk in self._response.content.iter_any():
            yield chunk


class AiohttpClient:
    """An httpx-shaped streaming POST over one aiohttp session; transport errors surface as httpx's
    exceptions.

    `/run` is the hot path: measured on this project's 2-core machine with 256 calls in flight,
    httpx.AsyncClient spent 32 ms of CPU per request in one pool and 2.6 ms with a pool per
    connection, an httpx client over an aiohttp transport 1.1 ms, aiohttp alone 0.48 ms. The
    callers keep httpx's vocabulary (its exception classes classify failures, and unit tests
    swap in an httpx.AsyncClient over httpx.MockTransport).
    """

    def __init__(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
            skip_auto_headers=("User-Agent",),
            auto_decompress=True,
            response_class=HeartbeatResponse,
        )

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, url: str, *, content: bytes, headers: dict[str, str]
    ) -> AsyncIterator[AiohttpReply]:
        """The reply, its body unread; errors while reading it are mapped too.

        Redirects are not followed: a 3xx is handed back like any other status (a redirected
        `/run` would send the prompt to another host, or turn into a GET).
        """
        try:
            async with self._session.request(
                method, url, data=content, headers=headers, allow_redirects=False
            ) as response:
                try:
                    yield AiohttpReply(response)
                finally:
                    if not response.content.at_eof():
                        # A body left unread (cut at the size limit, a stall) is not drained
                        # into memory for keep-alive: the connection is dropped.
                        response.close()
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        except aiohttp.ServerTimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "read timed out") from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise httpx.RemoteProtocolError(str(exc) or "server disconnected") from exc
        except aiohttp.ClientOSError as exc:
            raise httpx.ReadError(str(exc)) from exc
        except aiohttp.ClientError as exc:
            raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._session.close()


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


class ProcessIO:
    """A process's event loop thread and its `/run` client (made on first use, on that loop)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = EventLoopThread()
        self._http: AiohttpClient | None = None
        atexit.register(self.close)

    @property
    def http(self) -> AiohttpClient:
        """The `/run` client, made on first use (a process that only aggregates never opens one),
        always on the loop's thread: from there directly, from elsewhere through the loop."""
        found = self._http
        if found is not None:
            return found
        if threading.current_thread() is self.loop.thread:
            return self._made()
        return self.loop.run(self._make())

    def _made(self) -> AiohttpClient:
        if self._http is None:
            self._http = AiohttpClient()
        return self._http

    async def _make(self) -> AiohttpClient:
        return self._made()

    def close(self) -> None:
        """Close the client's connections (at exit, so nothing is reported unclosed)."""
        found, self._http = self._http, None
        if found is not None and os.getpid() == self.pid and self.loop.thread.is_alive():
            with contextlib.suppress(Exception):
                self.loop.submit(found.aclose()).result(timeout=5)


_io: PerProcess[None, ProcessIO] = PerProcess(lambda _: ProcessIO())


def process_io() -> ProcessIO:
    """This process's event loop thread and HTTP client, created on first use."""
    return _io.get(None)
