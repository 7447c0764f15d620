"""The producer's own Celery app: same settings as the workers', pointed at a chosen broker."""

from __future__ import annotations

from celery import Celery

from infra import json_codec
from infra.broker import transport_for


def client_app(broker_url: str, redis_url: str) -> Celery:
    """A Celery app for sending rollout tasks and reading the chord result; tasks are sent by name.
    Messages are encoded and decoded by `infra/json_codec.py`, as in the workers."""
    json_codec.install()
    app = Celery("rollouts-producer", set_as_current=False)
    app.config_from_object("celeryconfig")
    app.conf.update(
        broker_url=broker_url,
        broker_transport=transport_for(broker_url),
        result_backend=redis_url,
    )
    return app
