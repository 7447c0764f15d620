"""The Celery tasks: each validates its JSON payload, calls plain code, returns a small dict
(a rollout task's in `Shown`, which Celery renders for Flower in one `repr`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import Task
from celery.exceptions import Ignore
from celery.signals import worker_init, worker_ready
from pydantic import JsonValue

from infra.environment import from_env
from infra.store import RunDir
from schemas.health import (
    HEALTH_COMBINE_TASK,
    HEALTH_SCAN_TASK,
    QUALITY_SUMMARY,
    HealthPlan,
    ScanJob,
    ScanResult,
)
from schemas.messages import (
    COLLECT_TASK,
    FINISH_TASK,
    OMIT_TASK,
    CollectRequest,
    FinishRequest,
    OmitRequest,
    SharedParts,
)
from schemas.outcomes import VOID_ENDS, RolloutOutcome
from schemas.quality_summary import HealthBrief
from schemas.replies import COLLECT_REPLY_TASK, ReplyingCollectRequest
from workers import tracing
from workers.app import app, state_redis_url
from workers.finish import finish_here, finished_ahead, health_brief
from workers.gc_tuning import tune_gc
from workers.health import combine, scan
from workers.malloc_tuning import tune_malloc
from workers.omissions import omit
from workers.pool import on_loop, take_ran
from workers.redispatch import CollectTaskMessage
from workers.replies import ReplySummary, collect_and_reply
from workers.rollout import Delivery, run_rollout, run_rollout_async
from workers.task_results import shown
from workers.wiring import process_context

log = logging.getLogger(__name__)

FINISH_RETRY = {"max_retries": 10, "interval_start": 0.5, "interval_step": 1, "interval_max": 5}
"""How a finish task's publish rides out a broker that is away: about 40 s."""


def publish_finish(signature: dict[str, Any]) -> None:
    """Publish a generation's finish task: its rollout that settled last counted it done.

    Published with Celery's publish retries, for about 40 s. Should the broker stay away longer, the finish is lost with the error logged: the producer sees the run
    stall and says to resume it (`producer/shard/supervise.py`), which finishes it.
    """
    try:
        app.signature(signature).apply_async(retry=True, retry_policy=FINISH_RETRY)
    except Exception:
        log.exception("could not publish the finish task %s", signature.get("options", {}))


_PARTS = SharedParts()
"""This process's rollout requests share their run, policy, admission and health models."""


def _collect(request: Any, payload: dict[str, Any]) -> tuple[CollectRequest, Delivery]:
    """The rollout of a collect task's delivery: a run's takes its rollout's lease and counts
    toward its generation's finish."""
    req = _PARTS.validate(CollectRequest, payload)
    if request.group is None:  # a task sent outside a run's generation: no lease, no count
        return req, Delivery(returns_record=False)
    message = CollectTaskMessage.from_request(request, payload).to_json()
    return req, Delivery(message=message, finish=publish_finish, returns_record=False)


@on_loop(COLLECT_TASK, own_slot=True)
async def _collect_on_loop(request: Any, payload: dict[str, Any]) -> RolloutOutcome:
    req, delivery = _collect(request, payload)
    with tracing.delivery(request, payload) as traced:
        outcome = await run_rollout_async(req, process_context(state_redis_url()), delivery)
        traced.ended(outcome)
    return outcome


@app.task(name=COLLECT_TASK, acks_late=True, bind=True)
def collect_task(self: Task[Any, Any], payload: dict[str, Any]) -> Mapping[str, Any]:
    """Run one rollout and land its result exactly once.

    A run's delivery takes the rollout's lease, and settling it counts the rollout toward its
    generation's finish, once (`workers/rollout/leases.py`); one that is not the rollout's (a copy, or
    an attempt taken over) counts nothing and is acknowledged as ignored. A task sent outside a
    run's generation (no group) takes no lease. In the rollout pool the rollout ran on the event
    loop already (`_collect_on_loop`); in a thread pool it runs here.
    """
    outcome: RolloutOutcome | None = take_ran(self.request)
    if outcome is None:
        req, delivery = _collect(self.request, payload)
        with tracing.delivery(self.request, payload) as traced:
            outcome = run_rollout(req, process_context(state_redis_url()), delivery)
            traced.ended(outcome)
    if outcome.ended in VOID_ENDS:
        raise Ignore()
    return shown(outcome.chord_summary(), self.resultrepr_maxsize)  # what Flower shows


@app.task(name=FINISH_TASK, acks_late=True)
def finish_task(payload: dict[str, Any]) -> dict[str, JsonValue]:
    """Finish a shard: aggregate metrics, final status, manifest state. When a worker read the
    shard ahead, it ends the step (under the job's trace) and this returns what it recorded."""
    run, redis_url = FinishRequest.model_validate(payload).run, state_redis_url()
    finished = finished_ahead(run, redis_url)
    if finished is None:
        with tracing.finishing(finish_task.request, payload):
            finished = finish_here(run, redis_url)
    return finished.model_dump(mode="json")


@app.task(name=OMIT_TASK, acks_late=True)
def omit_task(payload: dict[str, Any]) -> dict[str, int]:
    """Write a recorded call's omissions (`_ng_omitted` rows) in its shard's sidecar."""
    return {"written": omit(OmitRequest.model_validate(payload), state_redis_url())}


@app.task(name=HEALTH_SCAN_TASK, acks_late=True)
def health_scan_task(payload: dict[str, Any]) -> dict[str, JsonValue]:
    """One recheck job: spool a byte range of one file of a run."""
    return scan(ScanJob.model_validate(payload)).model_dump(mode="json")


@app.task(name=HEALTH_COMBINE_TASK, acks_late=True)
def health_combine_task(results: list[dict[str, Any]], plan: dict[str, Any]) -> HealthBrief:
    """The chord callback of a distributed recheck: write the reports, return the verdict."""
    checked = HealthPlan.model_validate(plan)
    run = combine(checked, [ScanResult.model_validate(r) for r in results])
    return health_brief(run, RunDir(checked.report_dir).path(QUALITY_SUMMARY))


@on_loop(COLLECT_REPLY_TASK, own_slot=True)
async def _reply_on_loop(request: Any, payload: dict[str, Any]) -> ReplySummary:
    url = state_redis_url()
    req = _PARTS.validate(ReplyingCollectRequest, payload)
    message = CollectTaskMessage.from_request(request, payload, COLLECT_REPLY_TASK).to_json()
    with tracing.delivery(request, payload):
        return await collect_and_reply(req, url, process_context(url), message)


# No result stored: the outcome goes back on the invocation's reply list, not through Celery.
@app.task(name=COLLECT_REPLY_TASK, acks_late=True, ignore_result=True, bind=True)
def collect_reply_task(self: Task[Any, Any], payload: dict[str, Any]) -> Mapping[str, Any]:
    """Run one rollout for the Python API and push its outcome to the caller."""
    summary: ReplySummary | None = take_ran(self.request)
    if summary is None:
        ctx = process_context(state_redis_url())
        summary = ctx.loop.run(_reply_on_loop(self.request, payload))
    return shown(summary, self.resultrepr_maxsize)


@worker_init.connect
def _tune_malloc(**_: Any) -> None:
    """glibc's arena cap, before the worker starts its threads (`workers/malloc_tuning.py`)."""
    tune_malloc()


@worker_ready.connect
def _start_leases(**_: Any) -> None:
    """A worker takes over silent holders' rollouts from its start, before it runs any itself;
    then what is alive is frozen out of the garbage collector (`workers/gc_tuning.py`)."""
    process_context(state_redis_url())
    tune_gc(from_env().gc_thresholds)
