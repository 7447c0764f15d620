"""The Celery tasks: each validates its JSON payload, calls plain code, returns a small dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Task, states
from celery.exceptions import Ignore
from celery.signals import worker_ready

from infra.store import RunDir
from schemas.health import (
    HEALTH_COMBINE_TASK,
    HEALTH_SCAN_TASK,
    QUALITY_SUMMARY,
    HealthPlan,
    ScanJob,
    ScanResult,
)
from schemas.messages import COLLECT_TASK, FINISH_TASK, CollectRequest, FinishRequest
from schemas.outcomes import VOID_ENDS, RolloutOutcome
from schemas.replies import COLLECT_REPLY_TASK, ReplyingCollectRequest
from workers import tracing
from workers.app import app, state_redis_url
from workers.finish import finish_shard, health_brief
from workers.health import combine, scan
from workers.pool import delivery_key, on_loop, take_ran
from workers.redispatch import CollectTaskMessage
from workers.replies import collect_and_reply
from workers.rollout import Delivery, process_context, run_rollout, run_rollout_async

_settling: dict[tuple[str, int], Callable[[bool], object]] = {}
"""The lease each collect task settles once its chord part was counted, by delivery."""


class CollectTask(Task):  # type: ignore[misc]  # celery's Task is untyped here
    """The collect task's class: it settles its rollout's lease after Celery counted it."""

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        # Called in the tracer's thread once the task's result was stored and its chord part
        # counted (SUCCESS), or storing it failed.
        settle = _settling.pop(delivery_key(self.request), None)
        if settle is not None:
            settle(status == states.SUCCESS)


def _collect(request: Any, payload: dict[str, Any]) -> tuple[CollectRequest, Delivery]:
    """The rollout of a collect task's delivery: a chord's takes its rollout's lease."""
    req = CollectRequest.model_validate(payload)
    if request.group is None:  # a task sent outside a chord counts no chord part: no lease
        return req, Delivery()
    delivery = delivery_key(request)
    message = CollectTaskMessage.from_request(request, payload).to_json()
    _settling.pop(delivery, None)

    def settle_later(settle: Callable[[bool], object]) -> None:
        _settling[delivery] = settle

    return req, Delivery(message=message, settle_later=settle_later)


@on_loop(COLLECT_TASK)
async def _collect_on_loop(request: Any, payload: dict[str, Any]) -> RolloutOutcome:
    req, delivery = _collect(request, payload)
    with tracing.delivery(request, payload) as traced:
        outcome = await run_rollout_async(req, process_context(state_redis_url()), delivery)
        traced.ended(outcome)
    return outcome


@app.task(name=COLLECT_TASK, acks_late=True, bind=True, base=CollectTask)
def collect_task(self: Task[Any, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout and land its result exactly once.

    A chord's delivery takes the rollout's lease; one that is not the rollout's (a copy, or an
    attempt taken over) is acknowledged without a result: `Ignore` counts no chord part, so the
    chord counts each rollout once. A task sent outside a chord takes no lease. In the rollout
    pool the rollout ran on the event loop already (`_collect_on_loop`); in a thread pool it
    runs here.
    """
    outcome: RolloutOutcome | None = take_ran(self.request)
    if outcome is None:
        req, delivery = _collect(self.request, payload)
        with tracing.delivery(self.request, payload) as traced:
            outcome = run_rollout(req, process_context(state_redis_url()), delivery)
            traced.ended(outcome)
    if outcome.ended in VOID_ENDS:
        raise Ignore()
    return outcome.chord_summary()


@app.task(name=FINISH_TASK, acks_late=True)
def finish_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Finish a shard: aggregate metrics, final status, manifest state."""
    with tracing.finishing(finish_task.request, payload):
        finished = finish_shard(FinishRequest.model_validate(payload).run, state_redis_url())
    return finished.model_dump(mode="json")


@app.task(name=HEALTH_SCAN_TASK, acks_late=True)
def health_scan_task(payload: dict[str, Any]) -> dict[str, Any]:
    """One recheck job: spool a byte range of one file of a run."""
    return scan(ScanJob.model_validate(payload)).model_dump(mode="json")


@app.task(name=HEALTH_COMBINE_TASK, acks_late=True)
def health_combine_task(results: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """The chord callback of a distributed recheck: write the reports, return the verdict."""
    checked = HealthPlan.model_validate(plan)
    run = combine(checked, [ScanResult.model_validate(r) for r in results])
    return health_brief(run, RunDir(checked.report_dir).path(QUALITY_SUMMARY))


@on_loop(COLLECT_REPLY_TASK)
async def _reply_on_loop(request: Any, payload: dict[str, Any]) -> dict[str, Any]:
    url = state_redis_url()
    req = ReplyingCollectRequest.model_validate(payload)
    message = CollectTaskMessage.from_request(request, payload, COLLECT_REPLY_TASK).to_json()
    with tracing.delivery(request, payload):
        return await collect_and_reply(req, url, process_context(url), message)


# No result stored: the outcome goes back on the invocation's reply list, not through Celery.
@app.task(name=COLLECT_REPLY_TASK, acks_late=True, ignore_result=True, bind=True)
def collect_reply_task(self: Task[Any, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout for the Python API and push its outcome to the caller."""
    summary: dict[str, Any] | None = take_ran(self.request)
    if summary is not None:
        return summary
    ctx = process_context(state_redis_url())
    return ctx.loop.run(_reply_on_loop(self.request, payload))


@worker_ready.connect
def _start_leases(**_: Any) -> None:
    """A worker takes over silent holders' rollouts from its start, before it runs any itself."""
    process_context(state_redis_url())
