"""`rollouts health-check`: recheck a run directory from its persisted artifacts.

`health-check --distributed` sends the same plan a local recheck runs as a Celery chord: one
job per byte range of each file, combined by a callback that writes the reports into the run
directory (so workers and the callback must see the same storage as the run directory, as they
do for a run).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import orjson
from celery import chord
from pydantic import JsonValue
from rich.console import Console
from rich.markup import escape

from infra import jsonl
from infra.store import RunDir
from producer.shard.celery_client import client_app
from producer.shard.report import raise_if_unhealthy
from schemas.errors import RunFailedError, UsageError
from schemas.health import HEALTH_COMBINE_TASK, HEALTH_SCAN_TASK, QUALITY_SUMMARY, HealthPlan
from workers.health import console_line, plan_recheck, run_local

POLL_S = 0.5
RECHECK_LIMITS_HINT = "--limit max_failed_fraction=F or --limit max_failed_rollouts=N"


def parse_limits(values: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """`--limit name=value` pairs; `name=none` removes that limit."""
    out: dict[str, str | None] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--limit {item!r}: expected name=value")
        out[name.strip()] = value.strip()
    return out


def run_distributed(plan: HealthPlan, broker_url: str, redis_url: str) -> dict[str, JsonValue]:
    """The plan's jobs as a chord over the cluster's workers; returns the callback's brief."""
    app = client_app(broker_url, redis_url)
    header = [
        app.signature(HEALTH_SCAN_TASK, args=(job.model_dump(mode="json"),)) for job in plan.jobs
    ]
    body = app.signature(HEALTH_COMBINE_TASK, kwargs={"plan": plan.model_dump(mode="json")})
    result = chord(header, app=app)(body)
    while not result.ready():
        time.sleep(POLL_S)
    value = result.get(propagate=False, disable_sync_subtasks=False)
    if result.failed() or not isinstance(value, dict):
        # The combine step removes the scratch folder; after a failed job nobody else will.
        scratch = RunDir(plan.scratch)
        with contextlib.suppress(OSError):
            scratch.fs.rm(scratch.root, recursive=True)
        raise RunFailedError(f"the distributed health check failed: {value!r}")
    return value


def health_check(
    run_dir: str,
    *,
    rollouts_file: str | None,
    limits: dict[str, str | None],
    ignore: str | None,
    as_json: bool,
    distributed: bool,
    broker_url: str | None,
    redis_url: str | None,
    console: Console,
    fail_on_unhealthy: bool = False,
    capture_dir: str | None = None,
) -> int:
    """Recheck RUN_DIR from its persisted artifacts and write its reports; with
    `fail_on_unhealthy`, an UNHEALTHY verdict raises RunFailedError (exit 1)."""
    plan = plan_recheck(
        run_dir,
        rollouts_file=rollouts_file,
        limit_overrides=limits,
        ignored=[c for c in (ignore or "").split(",") if c.strip()],
        distributed=distributed,
        capture_dir=capture_dir,
    )
    run: Mapping[str, Any]
    if distributed:
        if not broker_url:
            raise UsageError("--distributed needs a broker (--broker or ROLLOUTS_BROKER_URL)")
        run = run_distributed(plan, broker_url, redis_url or broker_url)
    else:
        run = run_local(plan)
    report = RunDir(plan.report_dir)
    if as_json:
        # Compact, as NeMo Gym's --json prints it (the summary is read back from the folder).
        summary = jsonl.loads(report.read_bytes(QUALITY_SUMMARY))
        console.file.write(orjson.dumps(summary).decode() + "\n")
    else:
        line = console_line(run, report.path(QUALITY_SUMMARY), set_limit=RECHECK_LIMITS_HINT)
        console.print(escape(line), highlight=False)
    raise_if_unhealthy(run, fail_on_unhealthy, "--fail-on-unhealthy")
    return 0
