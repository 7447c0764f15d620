"""`rollouts report`: the run's report as one offline HTML file (workers/report builds it)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape

from infra.store import RunDir
from workers.health.sources import discover
from workers.report import write_report


def report(run_dir: str, output: str | None, console: Console) -> int:
    """Build RUN_DIR's report from its shards (a merged folder: the shards it lists, verified)
    and write it to `output`, else to `report.html` in RUN_DIR."""
    rd = RunDir(run_dir)
    sources = discover(rd, None)
    started = time.monotonic()
    path, digest = write_report(rd, sources, output)
    console.print(
        f"report: {escape(path)} ({digest.landed:,} landed, {digest.failure_rows:,} failure rows, "
        f"{len(digest.tasks):,} tasks; {time.monotonic() - started:.1f}s)",
        highlight=False,
    )
    return 0
