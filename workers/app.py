"""The one Celery app. `celery -A workers.app worker` and `rollouts worker` both start it."""

from __future__ import annotations

from celery import Celery
from celery.backends.base import Backend
from celery.backends.redis import RedisBackend

from infra import json_codec
from infra.environment import from_env, redis_url
from infra.redis_client import shared_pool
from workers.pool import PrefetchAhead
from workers.signal_wake import SignalWake


class _App(Celery):  # type: ignore[misc]
    """The Celery app, whose result backends share one bounded pool per process.

    Celery makes a result backend per thread and each opens its own pool: a 512-thread worker
    held a connection per thread beside its own pool's, for as long as it ran. Every backend
    here takes the pool `infra/redis_client.py` uses instead (bounded, released when idle).
    """

    def _get_backend(self) -> Backend:
        backend: Backend = super()._get_backend()
        if isinstance(backend, RedisBackend):
            backend._ConnectionPool = shared_pool
        return backend


json_codec.install()  # messages decoded by orjson where that decodes them the same

# `include` imports the task module when a worker starts, without a circular import here.
app = _App("rollouts", include=["workers.tasks"])
app.config_from_object("celeryconfig")
app.steps["consumer"].add(PrefetchAhead)  # a rollout pool's successors delivered ahead
app.steps["consumer"].add(SignalWake)  # a stop signal wakes the event loop at once


def state_redis_url() -> str:
    """The Redis that holds locks and landed sets: `ROLLOUTS_REDIS_URL`, else the result backend."""
    url = redis_url(from_env().redis_url or app.conf.result_backend)
    if url is None:
        raise RuntimeError("rollouts needs a Redis result backend (set ROLLOUTS_REDIS_URL)")
    return url
