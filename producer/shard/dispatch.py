"""Dispatching one generation of a shard: its counters, one collect task per rollout, its finish.

The rollout tasks and the finish task form the generation's chord, counted by the shard itself:
its size (`enqueued`) and the finish task's signature go in the generation's hash first
(`keys.shard_generation`), and the worker that settles the last rollout publishes the finish
(`workers/rollout/leases.py`). Celery's own chord would keep a result and a task id per rollout in
Redis until the callback (~220 bytes each); this keeps a bit. The tasks are published from a
stream of the materialized inputs, not built in memory, each with the generation's group id and
its index (what marks a run's rollout, and what Flower shows), built and published by
`workers/collect_messages.py`; with the `queue_window` setting only a window of them, the rest
published as rollouts settle (`workers/window.py`). `dispatch_generation` starts the
generation's Redis counters, publishes it and, when asked, waits for its finish
(`producer/shard/supervise.py`), all inside the generation's job span when telemetry is on
(`workers/tracing.py`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from rich.console import Console

from infra import generation, keys, telemetry
from infra.environment import from_env
from infra.redis_client import client
from producer.shard.feed import shard_feed
from producer.shard.opening import OpenedRun
from producer.shard.supervise import wait_for_shard
from schemas.config import ServersConfig
from schemas.finish import FinishResult
from schemas.messages import (
    FINISH_TASK,
    FinishRequest,
)
from schemas.settings import CollectionSettings
from workers.collect_messages import CollectMessages, TraceHeaders, publish_rows
from workers.shard.state import refresh_shard_keys
from workers.tracing import NO_JOB, Job, job
from workers.window import PRODUCER_SHARE, QueueWindow, WindowPlan, open_window


def enqueue(
    app: Celery,
    opened: OpenedRun,
    rows: Iterator[dict[str, Any]],
    count: int,
    config: ServersConfig,
    settings: CollectionSettings,
    deadline: float | None = None,
    job: Job = NO_JOB,
    window: int | None = None,
    inputs: str | None = None,
) -> str:
    """Publish one collect task per row, counted toward the finish task; returns the finish's id.

    `deadline` is the dispatch budget's end on the Redis server's clock, when there is a budget.
    `job`: the generation's job span; each task then roots its rollout's trace, linked to it.
    `window`: publish only the first `window` rows of the run directory's file `inputs` (`rows`
    are its rows, still read through here for what they count); the rest follow as rollouts
    settle (`workers/window.py`), those the workers publish linked to no job span.
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
    if window is not None and inputs is not None:
        sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
        plan = WindowPlan(window, count, opened.rd.url, inputs, group_id, prefix)
        pipe = r.pipeline(transaction=True)
        open_window(pipe, sid, opened.run.token, plan, messages)
        pipe.execute()
        QueueWindow(app, r, PRODUCER_SHARE, job_links(job, messages.run_payload)).refill(sid)
        for _ in rows:  # read through for what `rows` counts
            pass
        return finish_id
    traced = job_links(job, messages.run_payload)
    publish_rows(app, messages, enumerate(rows), group_id, prefix, traced)
    return finish_id


def job_links(job: Job, run: dict[str, Any]) -> TraceHeaders | None:
    """The trace headers of the tasks the producer publishes: each roots its rollout's trace,
    linked to the generation's job span; None when telemetry is off."""
    if not job.span:
        return None
    return lambda row, task_id: job.enqueued(row, run, task_id)


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
    wait: bool = True, inputs: str | None = None,
) -> FinishResult | None:  # fmt: skip
    """Enqueue `count` rows as this generation's chord and, with `wait`, return the finish result.

    `inputs`: the run directory's file `rows` are every row of (the shard's materialized inputs
    for `rollouts run`, the resume's inputs for `resume`), so the `queue_window` setting applies."""
    opened, settings = to.opened, to.settings
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    deadline = open_generation(
        client(to.redis_url), sid, opened.run.token, count, settings.dispatch_budget_s
    )
    if settings.telemetry_enabled:
        telemetry.request()
    run_id, shard = opened.manifest.run_id, opened.manifest.shard
    with job(run_id, shard, opened.run.token, count) as traced:
        window = settings.queue_window if inputs is not None and settings.queue_window else None
        finish_id = enqueue(
            to.app, opened, rows, count, to.config, settings, deadline, traced, window, inputs
        )
        console.print(f"enqueued {count} rollouts of {run_id} (shard {shard})")
        if not wait:
            return None
        refill = None
        if window is not None:
            links = job_links(traced, opened.run.model_dump(mode="json"))
            refiller = QueueWindow(to.app, client(to.redis_url), PRODUCER_SHARE, links)
            refill = functools.partial(refiller.refill, sid)
        finished = wait_for_shard(to.app, opened, to.redis_url, settings, console, finish_id,
                                  count, refill)  # fmt: skip
        traced.finished(finished.state, finished.error)
        return finished
