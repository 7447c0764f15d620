"""`rollouts aggregate`: merge shards, aggregate their metrics, check their health.

The merged file (`producer/ops/merge.py`) is sorted by (task, rollout) with duplicates kept and
reported; its metrics are aggregated per environment server as a run's finish step does, and
its health is checked from the shards it was merged from.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape

from infra import jsonl
from producer.config.loading import load_servers_config
from producer.ops.merge import MergeReport, merge_shards
from producer.shard.report import print_metrics_file
from schemas.config import ServersConfig
from schemas.errors import RunFailedError, UsageError
from schemas.health import QUALITY_SUMMARY
from workers.finish import write_aggregate_file
from workers.health import check_sources_here, console_line
from workers.health.sources import persisted_limits, source_for, stem_of
from workers.shard.ledger import iter_rows


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
    separate_datasets: bool = False,
) -> int:
    """Merge the shards, aggregate metrics and check health from them; exit 1 if aggregation failed.

    Shards whose (task, rollout) identities collide are refused (exit 2) unless they are
    `separate_datasets`."""
    report = merge_shards(input_glob, output, refuse_collisions=not separate_datasets)
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
        if report.collisions:
            console.print(
                "note: --separate-datasets: per-task metrics (pass@k) group together the tasks of "
                "different shards that share a task number"
            )
    config = _config_of(report, config_path)
    aggregate_name = f"{stem_of(report.name)}_aggregate_metrics.json"
    rows = itertools.chain.from_iterable(iter_rows(s.rd, s.name) for s in report.shards)
    error = write_aggregate_file(out, aggregate_name, rows, config, raise_on_error=False)
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
