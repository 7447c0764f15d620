"""A worker's Redis connections: bounded while hundreds of its rollouts run, released when idle.

Measured from the Redis server's side (`connected_clients`), with a real worker process of 64
threads whose pools are capped at 8 connections each and close their free connections after 2 s.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import start_servers
from examples.tasks import make_row
from tests.cluster import Workers
from tests.helpers import write_rows
from tests.ops_helpers import cli_background, wait_for

pytestmark = pytest.mark.integration

CAP = 8
THREADS = 64


def clients(r: redis.Redis) -> int:
    count: int = r.info("clients")["connected_clients"]
    return count


def test_a_busy_worker_holds_a_bounded_number_of_connections_and_lets_them_go_when_idle(
    redis_url: str, workers: Workers, tmp_path: Path
) -> None:
    servers = start_servers({"math_agent": "math_env"}, AgentKnobs(latency_ms=400))
    r = redis.Redis.from_url(redis_url)
    try:
        env = {"ROLLOUTS_REDIS_MAX_CONNECTIONS": str(CAP), "ROLLOUTS_REDIS_IDLE_S": "2"}
        workers.start(count=1, concurrency=THREADS, env=env)
        workers.wait_ready()
        time.sleep(1)
        idle = clients(r)  # the worker's broker connections, this test's own
        rows = [make_row("arithmetic", i, "math_agent") for i in range(4 * THREADS)]
        config = servers.write_config(str(tmp_path / "servers.yaml"))
        run = cli_background(
            "run", "--config", config, "--input", write_rows(tmp_path / "rows.jsonl", rows),
            "--output-dir", str(tmp_path / "run"), "--broker", redis_url,
            log=tmp_path / "run.log", env=env,
        )  # fmt: skip
        peak = [idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], clients(r))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            assert run.wait(180) == 0, (tmp_path / "run.log").read_text()
        finally:
            stop.set()
            sampler.join(5)
        # Beyond the idle worker: its state pool and its result backend's pool (CAP each), and
        # the producer's. Celery's own pool alone held a connection per busy thread.
        assert peak[0] - idle <= 2 * CAP + 12, (idle, peak[0])
        assert peak[0] - idle >= 10, "the run never kept connections busy: nothing to release"
        # Idle, it keeps what an idle worker has (its broker connections, a lease renewer's) and
        # closes the rest; the first measure was before its first rollout, so allow a few more.
        wait_for(lambda: clients(r) <= idle + 4, timeout=20, what="the idle worker's connections")
    finally:
        r.close()
        servers.stop()
