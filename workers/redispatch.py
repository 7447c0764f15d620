"""A collect task's message, as the producer's chord sends it and as a takeover sends it again.

`CollectTaskMessage` is what identifies one rollout task to Celery: its task id, its payload,
its chord (group id, index, callback) and what Flower shows of it. The producer's `enqueue`
publishes one per rollout (`publish_collect`); a collect task stores its own with its rollout's
lease (`from_request`), so that any live worker process that takes the lease over can publish
the very same message again (`publisher`), and the chord counts the rollout once it settles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from celery import Celery
from kombu.entity import Queue

from schemas.messages import COLLECT_TASK, QUEUE


@dataclass(frozen=True)
class CollectTaskMessage:
    """One rollout's collect task: enough to publish it again, byte for byte what Celery reads."""

    task_id: str
    payload: dict[str, Any]
    argsrepr: str
    group_id: str | None = None
    group_index: int | None = None
    chord: dict[str, Any] | None = None
    """The chord's callback signature (the finish task)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectTaskMessage:
        return cls(**data)

    @classmethod
    def from_request(cls, request: Any, payload: dict[str, Any]) -> CollectTaskMessage:
        """The message of the task `request` (a Celery task's `self.request`) carrying `payload`."""
        chord = request.chord
        return cls(
            task_id=request.id,
            payload=payload,
            argsrepr=getattr(request, "argsrepr", None) or "",
            group_id=request.group,
            group_index=request.group_index,
            chord=dict(chord) if chord is not None else None,
        )


def publish_collect(app: Celery, producer: Any, queue: Queue, m: CollectTaskMessage) -> None:
    """Publish `m` with Celery's own protocol-2 builder, through the anonymous exchange to the
    queue as Celery does for its default queue (`producer.batch` pipelines many)."""
    message = app.amqp.as_task_v2(
        m.task_id,
        COLLECT_TASK,
        args=(m.payload,),
        kwargs={},
        group_id=m.group_id,
        group_index=m.group_index,
        chord=m.chord,
        argsrepr=m.argsrepr,
        kwargsrepr="{}",
        # The chord counts the task without its result being stored; the rare outcome a caller
        # may read (a drained row) is stored by the task itself.
        ignore_result=True,
    )
    producer.publish(
        message.body,
        exchange="",
        routing_key=queue.name,
        serializer="json",
        headers=message.headers,
        retry=False,
        **message.properties,
    )


def publisher(app: Celery) -> Callable[[dict[str, Any]], None]:
    """Publish a stored message (`CollectTaskMessage.to_json`) again through `app`."""

    def publish(data: dict[str, Any]) -> None:
        m = CollectTaskMessage.from_json(data)
        queue = app.amqp.queues[QUEUE]
        with app.producer_or_acquire() as producer:
            producer.maybe_declare(queue)
            publish_collect(app, producer, queue, m)

    return publish
