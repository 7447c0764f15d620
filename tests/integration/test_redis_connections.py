"""A worker's Redis connections: bounded while hundreds of its rollouts run, released when idle.

Measured from the Redis server's side (`connected_clients`), with a real worker process of 64
threads whose pools are capped at 8 connections each and close their free connections after 2 s.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from examples.agent_server import AgentKnobs
from tests.helpers import math_rows
from tests.ops_helpers import wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

CAP = 8
THREADS = 64


def clients(r: redis.Redis) -> int:
    count: int = r.info("clients")["connected_clients"]
    return count


def test_a_busy_worker_holds_a_bounded_number_of_connections_and_lets_them_go_when_idle(
    make_run: MakeRun, r: redis.Redis
) -> None:
    env = {"ROLLOUTS_REDIS_MAX_CONNECTIONS": str(CAP), "ROLLOUTS_REDIS_IDLE_S": "2"}
    knobs = AgentKnobs(latency_ms=400)
    run = make_run({"math_agent": "math_env"}, knobs, concurrency=THREADS, env=env)
    time.sleep(1)
    idle = clients(r)  # the worker's broker connections, this test's own
    producer = run.start(math_rows(4 * THREADS), env=env)
    peak = [idle]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], clients(r))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        assert producer.wait(180) == 0, run.log()
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
    run.servers.stop()
