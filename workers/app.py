"""The one Celery app. `celery -A workers.app worker` and `rollouts worker` both start it."""

from __future__ import annotations

from celery import Celery

from infra.environment import from_env

# `include` imports the task module when a worker starts, without a circular import here.
app = Celery("rollouts", include=["workers.tasks"])
app.config_from_object("celeryconfig")


def state_redis_url() -> str:
    """The Redis that holds locks and landed sets: `ROLLOUTS_REDIS_URL`, else the result backend."""
    url = from_env().redis_url or app.conf.result_backend
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise RuntimeError("rollouts needs a Redis result backend (set ROLLOUTS_REDIS_URL)")
    return url
