"""The collectors a scenario compares: ours, an empty Celery chord, a plain asyncio+aiohttp loop."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.harness import BenchCluster, cpu_seconds
from infra.redis_client import client
from producer.celery_client import client_app
from producer.config_loading import load_servers_config
from producer.dispatch import (
    enqueue,
    iter_materialized,
    open_run,
    reset_shard_state,
    wait_for_finish,
)
from schemas.settings import CollectionSettings


@dataclass
class Measure:
    """One collector's run."""

    name: str
    n: int
    wall_s: float
    cpu_s: float
    extra: dict[str, Any]

    @property
    def rate(self) -> float:
        return self.n / self.wall_s

    @property
    def cpu_ms_per_rollout(self) -> float:
        return 1000 * self.cpu_s / self.n


def run_ours(
    cluster: BenchCluster, config_path: str, rows_path: str, out_dir: str, n: int, **settings: Any
) -> Measure:
    """A `rollouts run` against the cluster, timed from planning to the finished callback."""
    me = os.getpid()
    pids = [me, *cluster.pids()]
    groups = {
        "producer": [me],
        "workers": [p.pid for p in cluster.procs],
        "redis": [cluster.redis.pid or 0],
    }
    parts0 = {k: cpu_seconds(v) for k, v in groups.items()}
    cpu0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    config = load_servers_config(config_path)
    s = CollectionSettings.model_validate(settings)
    opened = open_run(
        input_path=rows_path, output_dir=out_dir, shard="0", config=config, settings=s
    )
    app = client_app(cluster.url, cluster.url)
    reset_shard_state(client(cluster.url), opened)
    t_enqueue = time.perf_counter()
    finish_id = enqueue(
        app, opened, iter_materialized(opened.rd, "0"), opened.manifest.planned, config, s
    )
    t_enqueued = time.perf_counter()
    result = wait_for_finish(app, finish_id, poll_s=0.05)
    t1 = time.perf_counter()
    cpu1 = cpu_seconds(pids)
    parts = {k: 1000 * (cpu_seconds(v) - parts0[k]) / n for k, v in groups.items()}
    app.close()
    assert result["landed"] == n, result
    return Measure(
        "rollouts (ours)",
        n,
        t1 - t_enqueue,
        cpu1 - cpu0,
        {"plan_s": t_enqueue - t0, "enqueue_s": t_enqueued - t_enqueue, "cpu_ms": parts},
    )


def run_empty_chord(cluster: BenchCluster, n: int) -> Measure:
    """A chord of n tasks that do nothing, built and published the standard Celery way."""
    from celery import chord

    app = client_app(cluster.url, cluster.url)
    pids = [os.getpid(), *cluster.pids()]
    groups = {
        "producer": [os.getpid()],
        "workers": [p.pid for p in cluster.procs],
        "redis": [cluster.redis.pid or 0],
    }
    parts0 = {k: cpu_seconds(v) for k, v in groups.items()}
    cpu0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    header = [app.signature("bench.noop") for _ in range(n)]
    res = chord(header, app=app)(app.signature("bench.done"))
    t_enq = time.perf_counter()
    while not res.ready():
        time.sleep(0.05)
    t1 = time.perf_counter()
    cpu1 = cpu_seconds(pids)
    parts = {k: 1000 * (cpu_seconds(v) - parts0[k]) / n for k, v in groups.items()}
    value = res.get(propagate=False)
    app.close()
    assert value == n, value
    return Measure(
        "empty Celery chord", n, t1 - t0, cpu1 - cpu0, {"enqueue_s": t_enq - t0, "cpu_ms": parts}
    )


async def _aiohttp_collect(
    url: str, rows: list[dict[str, Any]], concurrency: int, out: str
) -> None:
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        with open(out, "wb") as f:

            async def one(row: dict[str, Any]) -> None:
                async with sem, session.post(url + "/run", data=orjson.dumps(row),
                                             headers={"content-type": "application/json"}) as resp:  # fmt: skip
                    body = await resp.read()
                f.write(body + b"\n")

            await asyncio.gather(*(one(r) for r in rows))


def run_asyncio_aiohttp(
    agent_url: str, rows: list[dict[str, Any]], concurrency: int, out: str
) -> Measure:
    """The in-process baseline: one event loop, aiohttp, one JSONL line per result."""
    cpu0 = cpu_seconds([os.getpid()])
    t0 = time.perf_counter()
    asyncio.run(_aiohttp_collect(agent_url, rows, concurrency, out))
    t1 = time.perf_counter()
    return Measure(
        "asyncio + aiohttp (in-process)", len(rows), t1 - t0, cpu_seconds([os.getpid()]) - cpu0, {}
    )
