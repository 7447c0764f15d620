"""A TCP proxy that drops every connection idle for longer than a fixed time, as cloud load
balancers do (one cloud's is 340 s, not configurable): no byte in either direction for `idle_s`
and both sides are closed. It runs on its own event loop thread; `dropped` counts its cuts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class IdleDroppingProxy:
    """Forwards 127.0.0.1:<port> to `upstream` (host, port), cutting connections idle `idle_s`."""

    def __init__(self, upstream: tuple[str, int], idle_s: float) -> None:
        self.upstream = upstream
        self.idle_s = idle_s
        self.dropped = 0
        self.connections = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> IdleDroppingProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        up_r, up_w = await asyncio.open_connection(*self.upstream)
        last = [time.monotonic()]

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await r.read(65536):
                    last[0] = time.monotonic()
                    w.write(data)
                    await w.drain()

        pumps = [
            asyncio.ensure_future(pump(client_r, up_w)),
            asyncio.ensure_future(pump(up_r, client_w)),
        ]
        try:
            while not any(p.done() for p in pumps):
                await asyncio.sleep(0.1)
                if time.monotonic() - last[0] > self.idle_s:
                    self.dropped += 1
                    break
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (client_w, up_w):
                w.close()
