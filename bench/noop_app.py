"""The empty-task Celery baseline: same settings as the rollout workers, tasks that do nothing."""

from __future__ import annotations

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
    """Wait like an agent call would, doing nothing else: Celery's ceiling for the latency scenario."""
    time.sleep(seconds)


@app.task(name="bench.done", acks_late=True)
def done(results: Any = None) -> int:
    return len(results or [])
