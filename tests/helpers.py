"""Helpers every kind of test uses: the checkout's root, rows written and read as JSONL, the
example agent's counters, a value sampled in a thread while a run goes, an aiohttp app or a
stand-in HTTP server served on a free port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import orjson
from aiohttp import web

from examples.servers import RunningServers, free_port
from examples.tasks import make_row

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def write_rows(path: Path, rows: list[Any]) -> str:
    """`rows` as JSONL at `path` (a row given as text or bytes is written as it is)."""
    with open(path, "wb") as f:
        for row in rows:
            if isinstance(row, str):
                row = row.encode()
            f.write((row if isinstance(row, bytes) else orjson.dumps(row)) + b"\n")
    return str(path)


def demo_rows(n: int) -> list[dict[str, Any]]:
    """n rows alternating between the demo's two agents."""
    agents = [("math_agent", "arithmetic"), ("count_agent", "counting")]
    return [make_row(agents[i % 2][1], i, agents[i % 2][0]) for i in range(n)]


def math_rows(n: int) -> list[dict[str, Any]]:
    """n rows for the demo's math agent alone."""
    return [make_row("arithmetic", i, "math_agent") for i in range(n)]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                out.append(orjson.loads(line))
    return out


def read_object_jsonl(run_dir: str, name: str) -> list[dict[str, Any]]:
    """The rows of `name` read as one plain object/file, as any JSONL reader would read it."""
    from infra.store import RunDir

    rd = RunDir(run_dir)
    data: bytes = rd.fs.cat_file(rd.path(name))
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def agent_stats(servers: RunningServers, agent: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(servers.urls[agent] + "/stats").json()
    return stats


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free loopback port: its runner (to clean up) and its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    return runner, f"http://127.0.0.1:{port}"


class QuietHandler(BaseHTTPRequestHandler):
    """A handler of a test's stand-in HTTP server: it logs nothing and replies in one call."""

    def reply(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Sampler(Generic[T]):
    """Reads a value every `interval_s` in a thread until stopped: `samples` holds (when, value)."""

    def __init__(self, read: Callable[[], T], interval_s: float = 0.02) -> None:
        self.read = read
        self.interval_s = interval_s
        self.samples: list[tuple[float, T]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.read()))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def serve_in_thread(
    handler: type[BaseHTTPRequestHandler],
) -> tuple[ThreadingHTTPServer, threading.Thread, str]:
    """`handler` on a free loopback port, served by a daemon thread the caller starts: the
    server, the thread and the server's URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"
