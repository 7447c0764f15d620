"""The empty-task Celery baseline: same settings as the rollout workers, tasks that do nothing."""

from __future__ import annotations

from typing import Any

from celery import Celery

app = Celery("bench-noop")
app.config_from_object("celeryconfig")


@app.task(name="bench.noop", acks_late=True)
def noop(payload: Any = None) -> None:
    """Do nothing; the chord's per-task cost is all that remains."""
    return None


@app.task(name="bench.done", acks_late=True)
def done(results: Any = None) -> int:
    return len(results or [])
