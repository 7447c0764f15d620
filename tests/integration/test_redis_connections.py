"""A worker's Redis connections: bounded while hundreds of its rollouts run, released when idle.

Measured as the TCP connections the worker process holds to the Redis port (other processes on
the same Redis, such as a producer or an earlier test's worker still exiting, are not counted),
with a real worker process of 64 slots whose pools are capped at 8 connections each and close
their free connections after 2 s.
"""

from __future__ import annotations

import functools
import threading
import time
from urllib.parse import urlsplit

import psutil
import pytest

from examples.agent_server import AgentKnobs
from tests.helpers import math_rows
from tests.ops_helpers import wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

CAP = 8
THREADS = 64


def held(worker: psutil.Process, port: int) -> int:
    """The worker's TCP connections to Redis, whatever their state."""
    return sum(1 for c in worker.net_connections("tcp") if c.raddr and c.raddr.port == port)


def test_a_busy_worker_holds_a_bounded_number_of_connections_and_lets_them_go_when_idle(
    make_run: MakeRun, redis_url: str
) -> None:
    env = {"ROLLOUTS_REDIS_MAX_CONNECTIONS": str(CAP), "ROLLOUTS_REDIS_IDLE_S": "2"}
    knobs = AgentKnobs(latency_ms=400)
    run = make_run({"math_agent": "math_env"}, knobs, concurrency=THREADS, env=env)
    worker = psutil.Process(run.workers.procs[0].pid)
    port = urlsplit(redis_url).port
    assert port is not None
    clients = functools.partial(held, worker, port)
    time.sleep(1)
    idle = clients()  # the worker's broker connections, a lease renewer's
    producer = run.start(math_rows(4 * THREADS), env=env)
    peak = [idle]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], clients())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        assert producer.wait(180) == 0, run.log()
    finally:
        stop.set()
        sampler.join(5)
    # Beyond the idle worker: its state pool and its result backend's pool (CAP each), and a
    # few of its own (the read-ahead reader's, a lock keeper's). Celery's own pool alone held a
    # connection per busy slot.
    assert peak[0] - idle <= 2 * CAP + 6, (idle, peak[0])
    # Idle, it keeps what an idle worker has (its broker connections, a lease renewer's) and
    # closes the rest; the first measure was before its first rollout, so allow a few more. That
    # check means something only if the run opened more than those few (9 more, here).
    assert peak[0] - idle >= 6, "the run never kept connections busy: nothing to release"
    wait_for(lambda: clients() <= idle + 4, timeout=20, what="the idle worker's connections")
    run.servers.stop()
