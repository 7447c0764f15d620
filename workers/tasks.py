"""The Celery tasks: each validates its JSON payload, calls plain code, returns a small dict."""

from __future__ import annotations

import threading
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
from schemas.outcomes import VOID_ENDS
from schemas.replies import COLLECT_REPLY_TASK, ReplyingCollectRequest
from workers.app import app, state_redis_url
from workers.finish import finish_shard, health_brief
from workers.health import combine, scan
from workers.redispatch import CollectTaskMessage
from workers.replies import collect_and_reply
from workers.rollout import Delivery, process_context, run_rollout


class _Settling(threading.local):
    """The lease a collect task settles once its chord part was counted (per pool thread)."""

    settle: Callable[[bool], object] | None = None


_settling = _Settling()


def _settle_later(settle: Callable[[bool], object]) -> None:
    _settling.settle = settle


class CollectTask(Task):  # type: ignore[misc]  # celery's Task is untyped here
    """The collect task's class: it settles its rollout's lease after Celery counted it."""

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        # Called in the task's thread once its result was stored and its chord part counted
        # (SUCCESS), or storing it failed.
        settle, _settling.settle = _settling.settle, None
        if settle is not None:
            settle(status == states.SUCCESS)


@app.task(name=COLLECT_TASK, acks_late=True, bind=True, base=CollectTask)
def collect_task(self: Task[Any, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout and land its result exactly once.

    A chord's delivery takes the rollout's lease; one that is not the rollout's (a copy, or an
    attempt taken over) is acknowledged without a result: `Ignore` counts no chord part, so the
    chord counts each rollout once. A task sent outside a chord takes no lease.
    """
    url = state_redis_url()
    req = CollectRequest.model_validate(payload)
    delivery = Delivery()
    if self.request.group is not None:  # a task of a chord: one lease per rollout of it
        message = CollectTaskMessage.from_request(self.request, payload).to_json()
        delivery = Delivery(message=message, settle_later=_settle_later)
    _settling.settle = None
    outcome = run_rollout(req, process_context(url), delivery)
    if outcome.ended in VOID_ENDS:
        raise Ignore()
    return outcome.chord_summary()


@app.task(name=FINISH_TASK, acks_late=True)
def finish_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Finish a shard: aggregate metrics, final status, manifest state."""
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


# No result stored: the outcome goes back on the invocation's reply list, not through Celery.
@app.task(name=COLLECT_REPLY_TASK, acks_late=True, ignore_result=True)
def collect_reply_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout for the Python API and push its outcome to the caller."""
    url = state_redis_url()
    return collect_and_reply(
        ReplyingCollectRequest.model_validate(payload), url, process_context(url)
    )


@worker_ready.connect
def _start_leases(**_: Any) -> None:
    """A worker takes over silent holders' rollouts from its start, before it runs any itself."""
    process_context(state_redis_url())
