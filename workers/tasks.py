"""The Celery tasks: each validates its JSON payload, calls plain code, returns a small dict."""

from __future__ import annotations

from typing import Any

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
from schemas.replies import COLLECT_REPLY_TASK, ReplyingCollectRequest
from workers.app import app, state_redis_url
from workers.finish import finish_shard, health_brief
from workers.health import combine, scan
from workers.replies import collect_and_reply
from workers.rollout import process_context, run_rollout


@app.task(name=COLLECT_TASK, acks_late=True)
def collect_task(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one rollout and land its result exactly once."""
    url = state_redis_url()
    return run_rollout(CollectRequest.model_validate(payload), process_context(url)).chord_summary()


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
