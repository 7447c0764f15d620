"""What a finished run prints: where it is, its counts, its metrics per environment server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.errors import RunFailedError
from schemas.finish import FinishResult
from workers.aggregate_file import entry_heads
from workers.health.summary import console_line


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_metrics(console: Console, rd: RunDir, shard: str, keys_only: bool = True) -> None:
    print_metrics_file(console, rd, ShardFiles(shard).aggregate, keys_only)


def print_metrics_file(console: Console, rd: RunDir, name: str, keys_only: bool = True) -> None:
    if not rd.exists(name):
        console.print("no aggregate metrics were written")
        return
    with rd.open_document(name) as f:
        entries = entry_heads(f)  # without the per-task lists: a GB at a million rollouts
    for entry in entries:
        server = entry.get(F.ENVIRONMENT_SERVER)
        label = (entry.get("agent_ref") or {}).get("name")
        # A server labelled by its own name has no agent of its own (a task set's episodes).
        agent = f" (agent {escape(str(label))})" if label != server else ""
        console.print(f"[bold]environment {escape(str(server))}[/]{agent}")
        table = Table()
        table.add_column("metric")
        table.add_column("value", justify="right")
        if entry.get("aggregation_error"):
            table.add_row("aggregation_error", escape(str(entry["aggregation_error"])))
        metrics = entry.get("key_metrics") if keys_only else entry.get("agent_metrics")
        for name, value in sorted((metrics or {}).items()):
            table.add_row(escape(name), _fmt(value))
        console.print(table)


def print_counts(console: Console, result: FinishResult) -> None:
    """The coverage lines of the metrics (when they miss or impute rollouts), then the counts."""
    if result.coverage is not None:
        for line in result.coverage.lines():
            console.print(escape(line), highlight=False)
    console.print(
        f"landed {result.landed}/{result.planned} rollouts; state {result.state}"
        + (f"; error: {result.error}" if result.error else "")
    )


def print_health(
    console: Console, health: Mapping[str, Any] | None, report: str | None = None
) -> None:
    """The health verdict of a finished run (the finish step's brief of its quality summary),
    then where its report is."""
    if health is not None and health.get("error"):
        console.print(
            f"health check failed (the run is not affected): {escape(str(health['error']))}"
        )
    elif health is not None:
        console.print(escape(console_line(health, str(health.get("path")))), highlight=False)
    if report is not None:
        console.print(f"report: {escape(report)}", highlight=False)


def raise_if_unhealthy(
    health: Mapping[str, Any] | None, fail_on_unhealthy: bool, flag: str
) -> None:
    """RunFailedError (exit 1) when asked to fail on an UNHEALTHY verdict and it is one."""
    if fail_on_unhealthy and health is not None and health.get("healthy") is False:
        reasons = "; ".join(str(r) for r in health.get("reasons") or [])
        raise RunFailedError(
            f"the run's health verdict is UNHEALTHY ({flag})" + (f": {reasons}" if reasons else "")
        )
