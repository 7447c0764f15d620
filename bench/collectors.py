"""The collectors a scenario compares: ours, an empty Celery chord, a plain asyncio+aiohttp loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.harness import BenchCluster, cpu_seconds, status_mb
from infra.redis_client import client
from producer.config.loading import load_servers_config
from producer.shard.celery_client import client_app
from producer.shard.dispatch import enqueue
from producer.shard.opening import iter_materialized, open_run, reset_shard_state
from producer.shard.supervise import wait_for_finish
from schemas.settings import CollectionSettings
from workers import tracing
from workers.tracing import NO_JOB


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


def settle_results(app: Any) -> None:
    """Collect result objects now, while this cluster's Redis is up, then close the app.

    An AsyncResult left in a reference cycle unsubscribes from its result key when the cyclic
    collector gets to it; after the cluster is gone that unsubscribe retries its reconnects and
    stalls whatever measurement is running then.
    """
    import gc

    gc.collect()
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        consumer.subscribed_to.clear()
    app.close()


TRACED_WORKER_ENV = {"ROLLOUTS_OTEL_ENABLED": "1", "OTEL_BSP_SCHEDULE_DELAY": "1000"}
"""A traced run's workers: telemetry on, spans exported at least every second (5 s by default;
a batch of 512 is exported at once either way)."""


def cluster_groups(cluster: BenchCluster | None) -> dict[str, list[int]]:
    """The processes whose CPU a measure counts: this producer, the workers and Redis."""
    groups = {"producer": [os.getpid()]}
    if cluster is not None:
        groups["workers"] = [p.pid for p in cluster.procs]
        groups["redis"] = [cluster.redis.pid or 0]
    return groups


def run_ours(
    cluster: BenchCluster | None,
    config_path: str,
    rows_path: str,
    out_dir: str,
    n: int,
    url: str | None = None,
    traced: bool = False,
    **settings: Any,
) -> Measure:
    """A `rollouts run` against the cluster, timed from planning to the finished callback.

    Without a cluster (the producer in its own process, `url` given) only this process's CPU
    is counted. `traced`: inside a job span, each rollout its own trace (telemetry set up in
    this process and the cluster's workers; `bench/otlp_sink.py` takes the exports).
    """
    groups = cluster_groups(cluster)
    pids = [p for g in groups.values() for p in g]
    url = url or (cluster.url if cluster is not None else None)
    assert url is not None
    parts0 = {k: cpu_seconds(v) for k, v in groups.items()}
    cpu0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    config = load_servers_config(config_path)
    s = CollectionSettings.model_validate(settings)
    opened = open_run(
        input_path=rows_path, output_dir=out_dir, shard="0", config=config, settings=s
    )
    app = client_app(url, url)
    reset_shard_state(client(url), opened)
    t_enqueue = time.perf_counter()
    dispatched_at = time.time()
    with contextlib.ExitStack() as stack:
        job = NO_JOB
        if traced:
            m = opened.manifest
            job = stack.enter_context(tracing.job(m.run_id, m.shard, opened.run.token, n))
        finish_id = enqueue(
            app, opened, iter_materialized(opened.rd, "0"), opened.manifest.planned, config, s,
            job=job,
        )  # fmt: skip
        t_enqueued = time.perf_counter()
        result = wait_for_finish(app, finish_id, poll_s=0.05)
    t1 = time.perf_counter()
    if traced:  # the CPU of exporting the workers' last spans too (`TRACED_WORKER_ENV`)
        time.sleep(2.5)
    cpu1 = cpu_seconds(pids)
    parts = {k: 1000 * (cpu_seconds(v) - parts0[k]) / n for k, v in groups.items()}
    settle_results(app)
    assert result["landed"] == n, result
    return Measure(
        "rollouts (ours, telemetry on)" if traced else "rollouts (ours)",
        n,
        t1 - t_enqueue,
        cpu1 - cpu0,
        {"plan_s": t_enqueue - t0, "enqueue_s": t_enqueued - t_enqueue, "cpu_ms": parts,
         "dispatched_at": dispatched_at},
    )  # fmt: skip


def run_empty_chord(
    cluster: BenchCluster | None,
    n: int,
    url: str | None = None,
    sleep_s: float = 0.0,
    limit_s: float | None = None,
) -> Measure:
    """A chord of n tasks that do nothing (or only sleep), built and published the standard way.

    `limit_s`: stop waiting for it after that long (`extra["unfinished"]`; its wall time is the
    limit). The cluster must then be stopped: its workers still hold the chord's tasks.
    """
    from celery import chord

    url = url or (cluster.url if cluster is not None else None)
    assert url is not None
    app = client_app(url, url)
    groups = cluster_groups(cluster)
    pids = [p for g in groups.values() for p in g]
    parts0 = {k: cpu_seconds(v) for k, v in groups.items()}
    cpu0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    dispatched_at = time.time()
    if sleep_s:
        header = [app.signature("bench.sleep", (sleep_s,)) for _ in range(n)]
    else:
        header = [app.signature("bench.noop") for _ in range(n)]
    res = chord(header, app=app)(app.signature("bench.done"))
    t_enq = time.perf_counter()
    unfinished = False
    while not res.ready():
        if limit_s is not None and time.perf_counter() - t0 > limit_s:
            unfinished = True
            break
        time.sleep(0.05)
    t1 = time.perf_counter()
    cpu1 = cpu_seconds(pids)
    parts = {k: 1000 * (cpu_seconds(v) - parts0[k]) / n for k, v in groups.items()}
    value = None if unfinished else res.get(propagate=False)
    del res
    settle_results(app)
    assert unfinished or value == n, value
    name = f"Celery chord, tasks only sleep {sleep_s:g} s" if sleep_s else "empty Celery chord"
    extra = {"enqueue_s": t_enq - t0, "cpu_ms": parts, "dispatched_at": dispatched_at}
    if unfinished:
        extra["unfinished"] = limit_s
    return Measure(name, n, t1 - t0, cpu1 - cpu0, extra)


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
    cpu = cpu_seconds([os.getpid()]) - cpu0
    return Measure(
        "asyncio + aiohttp (in-process)",
        len(rows),
        t1 - t0,
        cpu,
        {"cpu_ms": {"producer": 1000 * cpu / len(rows)}},
    )


def run_asyncio_aiohttp_alone(
    agent_url: str, rows_path: str, concurrency: int, out: str
) -> Measure:
    """`run_asyncio_aiohttp` in a child interpreter of its own, so that its peak RSS is its own
    (`extra["rss_mb"]`: the peak during the run beyond what the child held before it, read
    from `VmHWM` reset at its start), not the benchmark process's reused heap."""
    import subprocess
    import sys

    from bench.harness import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", "from bench.collectors import _aiohttp_child; _aiohttp_child()",
         agent_url, rows_path, str(concurrency), out],
        capture_output=True, check=True, cwd=ROOT,
    )  # fmt: skip
    line = orjson.loads(proc.stdout.strip().splitlines()[-1])
    m = Measure(
        "asyncio + aiohttp (in-process)",
        int(line["n"]),
        float(line["wall_s"]),
        float(line["cpu_s"]),
        {"cpu_ms": {"producer": 1000 * float(line["cpu_s"]) / int(line["n"])},
         "dispatched_at": float(line["dispatched_at"])},
    )  # fmt: skip
    m.extra["rss_mb"] = float(line["rss_mb"])
    return m


def _aiohttp_child() -> None:
    """The child of `run_asyncio_aiohttp_alone`: argv agent URL, rows file, concurrency, out."""
    import sys

    url, rows_path, concurrency, out = sys.argv[1:5]
    with open(rows_path, "rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    # The peak from here on (where that is not permitted: from the start).
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = status_mb("VmRSS:")
    dispatched_at = time.time()
    m = run_asyncio_aiohttp(url, rows, int(concurrency), out)
    rss_mb = status_mb("VmHWM:") - before
    line = {"n": m.n, "wall_s": m.wall_s, "cpu_s": m.cpu_s, "rss_mb": rss_mb,
            "dispatched_at": dispatched_at}  # fmt: skip
    print(orjson.dumps(line).decode())


def nemo_gym_python(explicit: str | None = None, build: bool = False) -> str | None:
    """An interpreter with nemo-gym installed: the one named, $ROLLOUTS_BENCH_NEMO_PYTHON, this
    one, or that of the peer's venv (`bench/peer.py`), which `build` builds when it has none
    and a Python 3.13 is found (None, with a line on stderr saying why, when it cannot be)."""
    import importlib.util
    import subprocess
    import sys

    from bench import peer

    if explicit is not None:
        return explicit or None  # "" leaves NeMo Gym out
    if os.environ.get("ROLLOUTS_BENCH_NEMO_PYTHON"):
        return os.environ["ROLLOUTS_BENCH_NEMO_PYTHON"]
    if importlib.util.find_spec("nemo_gym") is not None:
        return sys.executable
    venv = peer.venv_dir()
    python = venv / "bin" / "python"
    if (venv / "bin" / "gym").exists() or not build:
        return str(python) if python.exists() else None
    print(f"building NeMo Gym's venv in {venv} (a few minutes)", file=sys.stderr)
    try:
        return str(peer.ensure_venv() / "bin" / "python")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"NeMo Gym left out: {exc}", file=sys.stderr)
        return None


def run_nemo_gym(
    python: str, agent_url: str, rows_path: str, concurrency: int, out: str
) -> Measure:
    """NeMo Gym 0.7.0's own in-process collector, in its own interpreter (bench/nemo_gym_driver.py)."""
    import subprocess

    from bench.harness import ROOT

    proc = subprocess.run(
        [python, str(ROOT / "bench" / "nemo_gym_driver.py"), "--agent-url", agent_url,
         "--rows", rows_path, "--out", out, "--concurrency", str(concurrency)],
        capture_output=True, check=True, cwd=ROOT,
    )  # fmt: skip
    line = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return Measure(
        "NeMo Gym 0.7.0 (in-process)",
        int(line["n"]),
        float(line["wall_s"]),
        float(line["cpu_s"]),
        {"cpu_ms": {"producer": 1000 * float(line["cpu_s"]) / int(line["n"])},
         "failed": line.get("failed") or {}, "dispatched_at": float(line["dispatched_at"])},
    )  # fmt: skip
