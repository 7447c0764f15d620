"""`python -m bench capture`: what the capture proxy adds per model call (issue 18).

The example model server and `rollouts capture-proxy` run in their own processes (their CPU is
read from /proc); this process sends N Responses API calls, as rollouts of 4 calls each, either
straight to the model server or through the proxy under `/ng-rollout/<key>/`, non-streamed and
streamed, one at a time (latency) and `--in-flight` at once (throughput, CPU). Each mode is run
in interleaved rounds and its best is shown. The proxy appends and fsyncs one capture line per
call on a local folder, as NeMo Gym's store does. Added latency is the proxy's p50 minus the
direct p50 of the same load; proxy CPU per call is the proxy process's CPU over the calls.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import aiohttp
import orjson
import psutil

from bench.harness import ROOT, cpu_seconds, quantile, table
from examples.servers import free_port

CALLS_PER_ROLLOUT = 4


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@dataclass
class Load:
    """One measured load: its latencies and the CPU each process spent on it."""

    mode: str
    stream: bool
    in_flight: int
    calls: int
    wall_s: float
    latencies_ms: list[float]
    model_cpu_s: float
    proxy_cpu_s: float

    def p(self, q: float) -> float:
        return quantile(self.latencies_ms, q)


async def _send(base: str, prefixed: bool, n: int, in_flight: int, stream: bool) -> list[float]:
    latencies: list[float] = []
    queue = list(range(n))
    body = {
        "model": "stand-in-1",
        "input": [{"role": "user", "content": "What is 17 + 25?"}],
        "metadata": {"expected_answer": "42", "difficulty": "0.2", "rollout_index": "0"},
        "stream": stream,
    }
    data = orjson.dumps(body)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                key = f"{i // CALLS_PER_ROLLOUT}-0"
                url = (
                    f"{base}/ng-rollout/{key}/v1/responses" if prefixed else f"{base}/v1/responses"
                )
                t0 = time.perf_counter()
                async with session.post(url, data=data, headers=headers) as reply:
                    await reply.read()
                    reply.raise_for_status()
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    return latencies


def capture(n: int, in_flight: int, rounds: int) -> str:
    tmp = tempfile.mkdtemp(prefix="bench-capture-")
    model_port, proxy_port = free_port(), free_port()
    model = subprocess.Popen(
        [sys.executable, "-m", "examples.model_server", "--port", str(model_port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proxy = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "capture-proxy", "--upstream",
         f"http://127.0.0.1:{model_port}", "--capture-dir", os.path.join(tmp, "calls"),
         "--port", str(proxy_port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_listening(model_port, model)
        _wait_listening(proxy_port, proxy)
        direct, through = f"http://127.0.0.1:{model_port}", f"http://127.0.0.1:{proxy_port}"
        # Warm both paths (connections, imports) before measuring.
        asyncio.run(_send(through, True, 64, 8, False))
        rss_start = psutil.Process(proxy.pid).memory_info().rss / 2**20
        best: dict[tuple[str, bool, int], Load] = {}
        for _ in range(rounds):
            for stream in (False, True):
                for flight in (1, in_flight):
                    calls = max(n // 10, 50) if flight == 1 else n
                    for mode, base in (("direct", direct), ("proxy", through)):
                        cpu0 = cpu_seconds([model.pid]), cpu_seconds([proxy.pid])
                        t0 = time.perf_counter()
                        lat = asyncio.run(_send(base, mode == "proxy", calls, flight, stream))
                        wall = time.perf_counter() - t0
                        cpu1 = cpu_seconds([model.pid]), cpu_seconds([proxy.pid])
                        load = Load(mode, stream, flight, calls, wall, lat,
                                    cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])  # fmt: skip
                        key = (mode, stream, flight)
                        if key not in best or load.p(0.5) < best[key].p(0.5):
                            best[key] = load
        rss_end = psutil.Process(proxy.pid).memory_info().rss / 2**20
        captured = sum(1 for _ in os.scandir(os.path.join(tmp, "calls")))
    finally:
        for proc in (proxy, model):
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    rows: list[list[object]] = []
    for (mode, stream, flight), load in sorted(
        best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])
    ):
        base = best[("direct", stream, flight)]
        rows.append([
            mode, "yes" if stream else "no", flight, load.calls, load.p(0.5), load.p(0.99),
            statistics.mean(load.latencies_ms), load.calls / load.wall_s,
            1000 * load.model_cpu_s / load.calls,
            "-" if mode == "direct" else 1000 * load.proxy_cpu_s / load.calls,
            "-" if mode == "direct" else load.p(0.5) - base.p(0.5),
        ])  # fmt: skip
    head = [
        "path", "streamed", "in flight", "calls", "p50 ms", "p99 ms", "mean ms", "calls/s",
        "model CPU ms/call", "proxy CPU ms/call", "added p50 ms",
    ]  # fmt: skip
    return (
        table(head, rows)
        + f"\n\nproxy RSS after warm-up {rss_start:.0f} MB, after every load {rss_end:.0f} MB; "
        f"{captured} capture files written"
    )
