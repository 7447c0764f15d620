"""`rollouts health-check` and `rollouts aggregate`: recheck a folder, merge shards, score them.

`health-check --distributed` sends the same plan a local recheck runs as a Celery chord: one
job per byte range of each file, combined by a callback that writes the reports into the run
directory (so workers and the callback must see the same storage as the run directory, as they
do for a run).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any

import orjson
from celery import chord
from rich.console import Console
from rich.markup import escape

from infra import jsonl
from infra.store import RunDir
from producer.config.loading import load_servers_config
from producer.ops.merge import MergeReport, merge_shards
from producer.shard.celery_client import client_app
from producer.shard.report import print_metrics_file
from schemas.config import ServersConfig
from schemas.errors import RunFailedError, UsageError
from schemas.health import HEALTH_COMBINE_TASK, HEALTH_SCAN_TASK, QUALITY_SUMMARY, HealthPlan
from workers.accounting import iter_rows
from workers.finish import write_aggregate_file
from workers.health import check_sources_here, console_line, plan_recheck, run_local
from workers.health.sources import persisted_limits, source_for, stem_of

POLL_S = 0.5


def parse_limits(values: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """`--limit name=value` pairs; `name=none` removes that limit."""
    out: dict[str, str | None] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--limit {item!r}: expected name=value")
        out[name.strip()] = value.strip()
    return out


def run_distributed(plan: HealthPlan, broker_url: str, redis_url: str) -> dict[str, Any]:
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
) -> int:
    """Recheck RUN_DIR from its persisted artifacts and write its reports."""
    plan = plan_recheck(
        run_dir,
        rollouts_file=rollouts_file,
        limit_overrides=limits,
        ignored=[c for c in (ignore or "").split(",") if c.strip()],
        distributed=distributed,
    )
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
        console.print(escape(console_line(run, report.path(QUALITY_SUMMARY))), highlight=False)
    return 0


def _config_of(report: MergeReport, config_path: str | None) -> ServersConfig:
    if config_path:
        return load_servers_config(config_path)
    merged: dict[str, dict[str, Any]] = {"agents": {}, "environments": {}, "resources_servers": {}}
    for shard in report.shards:
        name = f"{stem_of(shard.name)}_manifest.json"
        if not shard.rd.exists(name):
            continue
        config = jsonl.loads(shard.rd.read_bytes(name)).get("config") or {}
        for section, entries in merged.items():
            for key, value in (config.get(section) or {}).items():
                entries.setdefault(key, value)
    if not merged["agents"] and not merged["environments"]:
        raise UsageError("the shards have no manifest to take the servers from; pass --config")
    return ServersConfig.model_validate(merged)


def aggregate(
    input_glob: str,
    output: str,
    *,
    config_path: str | None,
    ignore: str | None,
    health: bool,
    console: Console,
) -> int:
    """Merge the shards, aggregate metrics and check health from them; exit 1 if aggregation failed."""
    report = merge_shards(input_glob, output)
    out = report.output
    console.print(
        f"merged {len(report.shards)} shards, {report.rows} rows, into {out.path(report.name)} "
        f"(record: {report.record_name})"
    )
    if report.duplicates:
        console.print(
            f"[bold yellow]{report.duplicates} duplicate rollouts[/] (same task and rollout index, "
            f"all kept); first: {escape(orjson.dumps(report.duplicate_examples[:3]).decode())}"
        )
    config = _config_of(report, config_path)
    aggregate_name = f"{stem_of(report.name)}_aggregate_metrics.json"
    rows = itertools.chain.from_iterable(iter_rows(s.rd, s.name) for s in report.shards)
    error = write_aggregate_file(out, aggregate_name, rows, config)
    print_metrics_file(console, out, aggregate_name)
    if health:
        sources = [source_for(s.rd, s.name, s.label) for s in report.shards]
        try:
            run = check_sources_here(
                out.url,
                sources,
                ignored=[c for c in (ignore or "").split(",") if c.strip()],
                limits=persisted_limits(out, sources),
            )
            console.print(escape(console_line(run, out.path(QUALITY_SUMMARY))), highlight=False)
        except UsageError:
            raise
        except Exception as exc:  # a report must not hide the merge and the metrics
            console.print(f"[red]health check failed:[/] {escape(str(exc))}")
    if error:
        raise RunFailedError(
            f"aggregation failed: {error} (saved {out.path(aggregate_name)} with the error recorded)"
        )
    return 0
