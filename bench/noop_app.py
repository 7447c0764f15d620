"""The empty-task Celery baseline: same settings as the rollout workers, tasks that do nothing."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

app = Celery("bench-noop")
app.config_from_object("celeryconfig")
# Stock Celery: kombu's own Redis transport, one ack transaction per message (ours batches them).
app.conf.broker_transport = None


@app.task(name="bench.noop", acks_late=True)
def noop(payload: Any = None) -> None:
    """Do nothing; the chord's per-task cost is all that remains."""
    return None


@app.task(name="bench.sleep", acks_late=True)
def sleep(seconds: float = 0.0) -> None:
    """Wait like an agent call would, doing nothing else: Celery's ceiling for the latency scenario.

    With `START_LOG` set, first appends its start time there (the chord's request log: its
    tasks call no agent)."""
    if START_LOG:
        os.write(_start_log(), f"{time.time()}\n".encode())
    time.sleep(seconds)


START_LOG = os.environ.get("ROLLOUTS_BENCH_START_LOG", "")
"""Where sleeping tasks log when they start (the latency scenario's wave start)."""
_fds: dict[int, int] = {}


def _start_log() -> int:
    """This process's descriptor of `START_LOG`, opened for appends (one small write is atomic)."""
    fd = _fds.get(os.getpid())
    if fd is None:
        fd = _fds[os.getpid()] = os.open(START_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return fd


@app.task(name="bench.done", acks_late=True)
def done(results: Any = None) -> int:
    return len(results or [])
