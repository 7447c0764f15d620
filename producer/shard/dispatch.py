"""Dispatching one generation of a shard: its counters, one collect task per rollout, its finish.

The rollout tasks and the finish task form the generation's chord, counted by the shard itself:
its size (`enqueued`) and the finish task's signature go in the generation's hash first
(`keys.shard_generation`), and the worker that settles the last rollout publishes the finish
(`workers/rollout/leases.py`). Celery's own chord would keep a result and a task id per rollout in
Redis until the callback (~220 bytes each); this keeps a bit. The tasks are published from a
stream of the materialized inputs, not built in memory, each with the generation's group id and
its index (what marks a run's rollout, and what Flower shows). `CollectMessages` builds every
rollout task's payload and what Flower shows of it (its argsrepr; its name is the task's own),
for a run and for the Python API's publisher. `dispatch_generation` starts the generation's
Redis counters, publishes it and, when asked, waits for its finish
(`producer/shard/supervise.py`), all inside the generation's job span when telemetry is on
(`workers/tracing.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from pydantic import JsonValue
from rich.console import Console

from infra import generation, keys, telemetry
from infra.environment import from_env
from infra.redis_client import client
from producer.shard.feed import shard_feed
from producer.shard.opening import OpenedRun
from producer.shard.supervise import wait_for_shard
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.feed import FeedPlan
from schemas.finish import FinishResult
from schemas.messages import (
    FINISH_TASK,
    QUEUE,
    Admission,
    CallPolicy,
    CaptureRef,
    FinishRequest,
    HealthRef,
    RunRef,
)
from schemas.settings import CollectionSettings
from workers.health.registry import normalize_ignored
from workers.redispatch import CollectTaskMessage, publish_collect
from workers.shard.state import refresh_shard_keys
from workers.tracing import NO_JOB, Job, job

PUBLISH_BATCH = 500


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


def enqueue(
    app: Celery,
    opened: OpenedRun,
    rows: Iterator[dict[str, Any]],
    count: int,
    config: ServersConfig,
    settings: CollectionSettings,
    deadline: float | None = None,
    job: Job = NO_JOB,
) -> str:
    """Publish one collect task per row, counted toward the finish task; returns the finish's id.

    `deadline` is the dispatch budget's end on the Redis server's clock, when there is a budget.
    `job`: the generation's job span; each task then roots its rollout's trace, linked to it.
    """
    finish_id = f"finish-{opened.manifest.run_id}-{opened.run.token[:8]}"
    finish_payload = FinishRequest(run=opened.run).model_dump(mode="json")
    callback = app.signature(FINISH_TASK, args=(finish_payload,), immutable=True)
    callback.set(
        task_id=finish_id, argsrepr=f"run={opened.manifest.run_id} shard={opened.manifest.shard}"
    )
    finish_headers = job.callback_headers()
    if finish_headers is not None:
        callback.set(headers=finish_headers)
    if count == 0:
        callback.apply_async()
        return finish_id
    group_id = f"gen-{opened.manifest.run_id}-{opened.run.token[:8]}"
    r = client(app.conf.result_backend)
    count_toward(r, opened, count, dict(callback))
    messages = CollectMessages.of(
        opened.run, config, settings, deadline, shard_feed(r, opened, settings)
    )
    prefix = f"{opened.manifest.run_id}.{opened.run.token[:8]}"
    queue = app.amqp.queues[QUEUE]
    with app.producer_or_acquire() as producer:
        producer.maybe_declare(queue)
        # One pipelined write per PUBLISH_BATCH messages (kombu's publish batch; immediate on
        # brokers without it), messages built as `workers/redispatch.py` says. send_task
        # per message costs 8x the CPU: a new Redis client and a round trip per message, and
        # an AsyncResult that subscribes and unsubscribes to the result channel.
        with producer.batch(PUBLISH_BATCH):
            for index, row in enumerate(rows):
                rid = F.rollout_id(row)
                payload, argsrepr = messages.message(row, rid, F.dispatch_target(row) or "")
                task_id = f"{prefix}.{rid}"
                traced = job.enqueued(row, messages.run_payload, task_id) if job.span else None
                m = CollectTaskMessage(task_id, payload, argsrepr, group_id, index, None, traced)
                publish_collect(app, producer, queue, m)
    return finish_id


def count_toward(r: redis.Redis, opened: OpenedRun, count: int, finish: dict[str, Any]) -> None:
    """The generation's chord: its `count` rollouts settle toward `finish` (`SETTLE_LUA`)."""
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    pipe = r.pipeline(transaction=True)
    generation.write_counting(pipe, sid, opened.run.token, count, json.dumps(finish))
    pipe.expire(keys.shard_generation(sid), from_env().live_key_ttl_s)
    pipe.execute()


def open_generation(
    r: redis.Redis, sid: str, token: str, enqueued: int, budget_s: float | None
) -> float | None:
    """Start the generation's counters; returns the dispatch deadline on Redis's clock, if budgeted."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    deadline = now + budget_s if budget_s is not None else None
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.shard_generation(sid), keys.shard_durations(sid))
    generation.write_opening(pipe, sid, token, enqueued, now, deadline)
    # The finish of an earlier generation set them to expire: they live while this one runs.
    refresh_shard_keys(pipe, sid, token)
    pipe.execute()
    return deadline


@dataclass(frozen=True)
class ShardDispatch:
    """An opened shard, the cluster it is dispatched to, and what its tasks are sent with."""

    app: Celery
    redis_url: str
    opened: OpenedRun
    config: ServersConfig
    settings: CollectionSettings


def dispatch_generation(
    to: ShardDispatch, rows: Iterator[dict[str, Any]], count: int, console: Console,
    wait: bool = True,
) -> FinishResult | None:  # fmt: skip
    """Enqueue `count` rows as this generation's chord and, with `wait`, return the finish result."""
    opened, settings = to.opened, to.settings
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    deadline = open_generation(
        client(to.redis_url), sid, opened.run.token, count, settings.dispatch_budget_s
    )
    if settings.telemetry_enabled:
        telemetry.request()
    run_id, shard = opened.manifest.run_id, opened.manifest.shard
    with job(run_id, shard, opened.run.token, count) as traced:
        finish_id = enqueue(to.app, opened, rows, count, to.config, settings, deadline, traced)
        console.print(f"enqueued {count} rollouts of {run_id} (shard {shard})")
        if not wait:
            return None
        finished = wait_for_shard(to.app, opened, to.redis_url, settings, console, finish_id,
                                  count)  # fmt: skip
        traced.finished(finished.state, finished.error)
        return finished
