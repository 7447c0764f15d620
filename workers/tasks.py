"""The Celery tasks: each validates its JSON payload, calls plain code, returns a small dict."""

from __future__ import annotations

from typing import Any

from schemas.messages import COLLECT_TASK, FINISH_TASK, CollectRequest, FinishRequest
from workers.app import app, state_redis_url
from workers.collect import collect
from workers.finish import finish_shard


@app.task(name=COLLECT_TASK, acks_late=True)
def collect_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout and land its result exactly once."""
    return collect(CollectRequest.model_validate(payload), state_redis_url())


@app.task(name=FINISH_TASK, acks_late=True)
def finish_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Finish a shard: aggregate metrics, final status, manifest state."""
    return finish_shard(FinishRequest.model_validate(payload).run, state_redis_url())
