"""What every rollout task of a generation is sent with, one row's message, and their publish.

`CollectMessages` builds every rollout task's payload and what Flower shows of it (its argsrepr;
its name is the task's own), for a run's dispatch (`producer/shard/dispatch.py`), the queue
window's refill (`workers/window.py`, which keeps it in Redis as JSON) and the Python API's
publisher (`producer/api/transport.py`). `publish_rows` publishes a generation's rows with it,
for the dispatch and the refill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from pydantic import JsonValue

from schemas import fields as F
from schemas.config import ServersConfig
from schemas.feed import FeedPlan
from schemas.messages import QUEUE, Admission, CallPolicy, CaptureRef, HealthRef, RunRef
from schemas.settings import CollectionSettings
from workers.health.registry import normalize_ignored
from workers.redispatch import CollectTaskMessage, publish_collect

PUBLISH_BATCH = 500
"""Messages per pipelined broker write (kombu's publish batch)."""

TraceHeaders = Callable[[dict[str, Any], str], dict[str, str | int] | None]
"""The trace headers of a row's task (its id given), linking it to its generation's job span."""


def call_policy(settings: CollectionSettings) -> CallPolicy:
    return CallPolicy(
        timeout_s=settings.rollout_timeout_s,
        max_reply_bytes=settings.max_reply_bytes,
        read_idle_timeout_s=settings.read_idle_timeout_s,
        heartbeat_s=settings.http_heartbeat_s,
        retry_requests=settings.retry_requests,
        max_attempts=settings.max_attempts,
        route_failures_to_sidecar=settings.route_failures_to_sidecar,
        connect_retries=settings.connect_retries,
        backoff_base_s=settings.retry_backoff_s,
        rate_limit_budget_s=settings.rate_limit_budget_s,
        rate_limit_max_wait_s=settings.rate_limit_max_wait_s,
    )


def capture_ref(settings: CollectionSettings) -> dict[str, JsonValue] | None:
    """What each rollout task is told of the capture dir; None with observability off."""
    if not settings.observability_enabled or settings.model_call_capture_dir is None:
        return None
    ref = CaptureRef(
        dir=settings.model_call_capture_dir,
        delete_after_merge=settings.delete_model_call_capture,
        include_payloads=settings.include_model_call_payloads,
    )
    return ref.model_dump(mode="json", exclude_defaults=True)


def health_ref(settings: CollectionSettings) -> dict[str, JsonValue] | None:
    """What each rollout task is told of live health: judge and count its result's verdict,
    skipping the run's ignored checks; None when the finish step will not check the run."""
    if settings.disable_health_check or settings.disable_aggregation:
        return None
    ignored = list(normalize_ignored(settings.health_check_ignored_checks))
    return HealthRef(ignored=ignored).model_dump(mode="json")


def admissions(
    config: ServersConfig, settings: CollectionSettings, deadline: float | None
) -> dict[str, dict[str, Any]]:
    """The admission payload of each agent's rollouts: the run's caps, its agent's cap, the budget."""
    caps = {name: agent.max_concurrency for name, agent in config.agents.items()}
    # A task row's `/run` goes to its environment server, under the same run-wide caps.
    caps.update({name: None for name in config.environments})
    return {
        name: Admission(
            max_resident_tasks=settings.max_resident_tasks,
            agent_max_concurrency=cap,
            dispatch_deadline=deadline,
            dispatch_budget_s=settings.dispatch_budget_s if deadline is not None else None,
            drain_margin_s=settings.drain_margin_s,
        ).model_dump(mode="json", exclude_defaults=True)
        for name, cap in caps.items()
    }


@dataclass(frozen=True)
class CollectMessages:
    """The collect tasks of one generation: the payload every task carries, and one row's message.

    The one builder of rollout task payloads, for the chord (`enqueue`) and the Python API's
    publisher (`producer/api/transport.py`).
    """

    run: RunRef
    run_payload: dict[str, Any]
    policy: dict[str, Any]
    urls: dict[str, str]
    """Each agent's URL, and each environment server's (where task rows' episodes go)."""
    gates: dict[str, dict[str, Any]]
    """Each agent's and environment server's admission payload (`admissions`)."""
    capture: dict[str, Any] | None = None
    """The run's capture dir payload, when observability is on."""
    health: dict[str, Any] | None = None
    """The live health payload, when the run's health check is on."""
    feed: FeedPlan | None = None
    """The dispatch's feed and its groups, when it has one."""

    @classmethod
    def of(
        cls,
        run: RunRef,
        config: ServersConfig,
        settings: CollectionSettings,
        deadline: float | None,
        feed: FeedPlan | None = None,
    ) -> CollectMessages:
        """`deadline`: the dispatch budget's end on the Redis server's clock, when budgeted."""
        return cls(
            run=run,
            run_payload=run.model_dump(mode="json"),
            policy=call_policy(settings).model_dump(mode="json"),
            urls=call_urls(config),
            gates=admissions(config, settings, deadline),
            capture=capture_ref(settings),
            health=health_ref(settings),
            feed=feed,
        )

    def to_json(self) -> dict[str, Any]:
        """Everything but the row, as JSON: what a refiller of the queue window rebuilds it from."""
        data = dict(vars(self))
        data["run"] = self.run.model_dump(mode="json")
        data["feed"] = self.feed.model_dump(mode="json") if self.feed is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectMessages:
        feed = data.get("feed")
        return cls(
            **{
                **data,
                "run": RunRef.model_validate(data["run"]),
                "feed": FeedPlan.model_validate(feed) if feed is not None else None,
            }
        )

    def message(
        self, row: dict[str, Any], rid: str | None, agent: str, reply: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], str]:
        """(payload, argsrepr) of one row's task to `agent` (a task row's: its environment server).

        The task keeps its fixed name (Celery counts a worker's tasks by name: one name per
        rollout would grow `inspect stats` and Flower's worker stats by a key per rollout); the
        run and the rollout go in the argsrepr, which Flower and worker logs show as its args.
        """
        payload = {"run": self.run_payload, "agent_url": self.urls[agent], "policy": self.policy,
                   "row": row}  # fmt: skip
        if reply is not None:
            payload["reply"] = reply
        if self.gates[agent]:
            payload["admission"] = self.gates[agent]
        if self.capture is not None:
            payload["capture"] = self.capture
        if self.health is not None and (reply is None or reply.get("record", True)):
            payload["health"] = self.health  # judged where it lands: not for an unrecorded call
        if self.feed is not None:
            payload["feed"] = self.feed.member(row)
        run = self.run
        return payload, f"run={run.run_id} shard={run.shard} rollout={rid}"


def call_urls(config: ServersConfig) -> dict[str, str]:
    """Where each server's `/run` listens: every agent's URL, and every environment server's
    (a task row's episode is run there)."""
    return {
        **{name: env.url for name, env in config.environments.items()},
        **{name: agent.url for name, agent in config.agents.items()},
    }


def publish_rows(
    app: Celery,
    messages: CollectMessages,
    rows: Iterable[tuple[int, dict[str, Any]]],
    group_id: str,
    task_prefix: str,
    traced: TraceHeaders | None = None,
) -> int:
    """Publish one collect task per `(index, row)` of a generation, each with its group id and
    index and the id `<task_prefix>.<rollout id>`; returns how many.

    One pipelined write per PUBLISH_BATCH messages (kombu's publish batch; immediate on brokers
    without it), messages built as `workers/redispatch.py` says. send_task per message costs 8x
    the CPU: a new Redis client and a round trip per message, and an AsyncResult that subscribes
    and unsubscribes to the result channel.
    """
    queue = app.amqp.queues[QUEUE]
    sent = 0
    with app.producer_or_acquire() as producer:
        producer.maybe_declare(queue)
        with producer.batch(PUBLISH_BATCH):
            for index, row in rows:
                rid = F.rollout_id(row)
                payload, argsrepr = messages.message(row, rid, F.dispatch_target(row) or "")
                task_id = f"{task_prefix}.{rid}"
                headers = traced(row, task_id) if traced is not None else None
                m = CollectTaskMessage(task_id, payload, argsrepr, group_id, index, None, headers)
                publish_collect(app, producer, queue, m)
                sent += 1
    return sent
