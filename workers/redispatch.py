"""A collect task's message, as the producer sends it and as a takeover sends it again.

`CollectTaskMessage` is what identifies one rollout task to Celery: its task id, its payload,
its group (the generation's id and its index; a chord callback only in messages of earlier
versions) and what Flower shows of it. The producer's `enqueue` publishes one per rollout
(`publish_collect`); a collect task stores its own with its rollout's lease (`from_request`), so
that any live worker process that takes the lease over can publish the very same message again
(`publisher`), and the rollout counts toward its generation's finish once it settles. The Python
API's reply task (`schemas.replies`) is kept and published again the same way, under its own
task name and with no group.
A traced run's message carries its rollout's trace context in its headers; a message published
again keeps it (with a new publish time), so each attempt joins the rollout's one trace.

A message a worker took from the queue and froze or died before starting holds no lease yet.
`UnackedSweep` finds such messages in kombu's unacknowledged index (a Redis broker's) once they
are older than the lease TTL, and publishes those whose rollout holds no lease and has not
settled again, once each: a copy that races a live delivery only finds its lease and is
acknowledged.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import redis
from celery import Celery
from kombu.entity import Queue

from infra import keys
from infra.environment import redis_url
from infra.redis_client import client
from infra.telemetry import ENQUEUED_AT, TRACEPARENT, TRACESTATE
from schemas.messages import COLLECT_TASK, QUEUE
from schemas.replies import COLLECT_REPLY_TASK, admission_row
from workers.shard.landed import settled
from workers.shard.state import key_str

log = logging.getLogger(__name__)

TRACE_HEADERS = (TRACEPARENT, TRACESTATE, ENQUEUED_AT)
"""The message headers a rollout's trace context travels in."""

SWEEP_BATCH = 200
"""Old unacknowledged messages one sweep looks at."""


@dataclass(frozen=True)
class CollectTaskMessage:
    """One rollout's collect task: enough to publish it again, byte for byte what Celery reads."""

    task_id: str
    payload: dict[str, Any]
    argsrepr: str
    group_id: str | None = None
    group_index: int | None = None
    chord: dict[str, Any] | None = None
    """A Celery chord's callback signature: None in what rollouts publishes (a generation counts
    its rollouts itself, `workers/rollout/leases.py`)."""
    headers: dict[str, Any] | None = None
    """The rollout's trace context (`traceparent`, its publish time), when its run is traced
    (`workers/tracing.py`): a redelivery and a re-publish keep it, so every attempt of the
    rollout is in one trace."""
    task: str = COLLECT_TASK
    """The task's name: a run's collect task, or the Python API's reply task (no group)."""

    def to_json(self) -> dict[str, Any]:
        """Its fields as a dict for JSON, sharing their values (`asdict` deep-copied the payload:
        a twentieth of a worker's time per rollout, measured)."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectTaskMessage:
        return cls(**data)

    @classmethod
    def from_request(
        cls, request: Any, payload: dict[str, Any], task: str = COLLECT_TASK
    ) -> CollectTaskMessage:
        """The message of the task `request` (a Celery task's `self.request`) carrying `payload`."""
        chord = request.chord
        return cls(
            task=task,
            task_id=request.id,
            payload=payload,
            argsrepr=getattr(request, "argsrepr", None) or "",
            group_id=request.group,
            group_index=request.group_index,
            chord=dict(chord) if chord is not None else None,
            headers=trace_headers({k: getattr(request, k, None) for k in TRACE_HEADERS}),
        )


def trace_headers(headers: dict[str, Any]) -> dict[str, str | int] | None:
    """The trace headers among a message's headers (a Celery request's attributes), if any."""
    if headers.get(TRACEPARENT) is None:
        return None
    return {k: headers[k] for k in TRACE_HEADERS if headers.get(k) is not None}


def publish_collect(app: Celery, producer: Any, queue: Queue, m: CollectTaskMessage) -> None:
    """Publish `m` with Celery's own protocol-2 builder, through the anonymous exchange to the
    queue as Celery does for its default queue (`producer.batch` pipelines many)."""
    message = app.amqp.as_task_v2(
        m.task_id,
        m.task,
        args=(m.payload,),
        kwargs={},
        group_id=m.group_id,
        group_index=m.group_index,
        chord=m.chord,
        argsrepr=m.argsrepr,
        kwargsrepr="{}",
        # No result is stored: the generation counts the task as it settles; the rare outcome a
        # caller may read (a drained row) is stored by the task itself.
        ignore_result=True,
    )
    if m.headers:
        message.headers.update(m.headers)
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
        if m.headers:  # this attempt's queue wait starts now
            m = replace(m, headers={**m.headers, ENQUEUED_AT: time.time_ns()})
        queue = app.amqp.queues[QUEUE]
        with app.producer_or_acquire() as producer:
            producer.maybe_declare(queue)
            publish_collect(app, producer, queue, m)

    return publish


def from_delivered(message: dict[str, Any]) -> CollectTaskMessage | None:
    """The rollout task (a run's collect task, or the Python API's reply task) in a message as
    kombu's Redis transport keeps it; else None."""
    headers = message.get("headers") or {}
    task = headers.get("task")
    if not (task == COLLECT_TASK and headers.get("group")) and task != COLLECT_REPLY_TASK:
        return None
    if message.get("properties", {}).get("body_encoding") != "base64":
        return None
    args, _kwargs, embed = json.loads(base64.b64decode(message["body"]))
    return CollectTaskMessage(
        task_id=headers["id"],
        payload=args[0],
        argsrepr=headers.get("argsrepr") or "",
        group_id=headers.get("group"),
        group_index=headers.get("group_index"),
        chord=embed.get("chord"),
        headers=trace_headers(headers),
        task=task,
    )


class UnackedSweep:
    """Publishes again the rollout tasks a silent worker took from a Redis broker and never
    started."""

    def __init__(
        self,
        broker: redis.Redis,
        state: redis.Redis,
        publish: Callable[[dict[str, Any]], None],
        ttl_s: float,
    ) -> None:
        self.broker = broker
        self.state = state
        self.publish = publish
        self.ttl_s = ttl_s

    def sweep(self) -> int:
        """One look at messages unacknowledged for longer than the lease TTL; returns how many
        were published again."""
        cutoff = time.time() - self.ttl_s
        tags: list[bytes] = self.broker.zrangebyscore(  # type: ignore[assignment]
            keys.KOMBU_UNACKED_INDEX, 0, cutoff, start=0, num=SWEEP_BATCH
        )
        if not tags:
            return 0
        raws: list[bytes | None] = self.broker.hmget(keys.KOMBU_UNACKED, tags)  # type: ignore[assignment]
        published = 0
        for tag, raw in zip(tags, raws, strict=True):
            m = from_delivered(json.loads(raw)[0]) if raw is not None else None
            if m is not None and self._unstarted(m) and self._first(tag.decode()):
                self.publish(m.to_json())
                log.warning("task %s was taken by a worker that never started it; "
                            "published it again", m.task_id)  # fmt: skip
                published += 1
        return published

    def _unstarted(self, m: CollectTaskMessage) -> bool:
        """No attempt of the rollout holds a lease, and it has not settled in its generation."""
        run = m.payload["run"]
        key = key_str(admission_row(m.payload["row"], m.payload.get("reply")))
        sid = keys.shard_id(run["output_dir"], run["shard"])
        leased = self.state.hexists(keys.shard_rollout_leases(sid), key)
        return not leased and not settled(self.state, sid, run["token"], key)

    def _first(self, tag: str) -> bool:
        ex = max(1, int(10 * self.ttl_s))
        return bool(self.state.set(keys.restored_message(tag), 1, nx=True, ex=ex))


def unacked_sweep(
    app: Celery, state_redis_url: str, publish: Callable[[dict[str, Any]], None], ttl_s: float
) -> UnackedSweep | None:
    """The sweep for `app`'s broker when it is a Redis (another broker redelivers by itself)."""
    url = redis_url(app.conf.broker_url)
    if url is None:
        return None
    return UnackedSweep(client(url), client(state_redis_url), publish, ttl_s)
