"""Build a run's report and save it: for `rollouts report` and for the finish step."""

from __future__ import annotations

import logging
import os
import posixpath

from infra.store import RunDir
from schemas.health import Source
from workers.report.digest import RunDigest, digest_run
from workers.report.page import render

REPORT_NAME = "report.html"
"""The report's name in the run directory, beside the quality summary."""

log = logging.getLogger(__name__)


def build_report(report_dir: RunDir, sources: list[Source]) -> tuple[bytes, RunDigest]:
    """The page for `sources` (with the health reports found in `report_dir`), and its digest."""
    digest = digest_run(report_dir, sources)
    return render(digest, title=f"Run report: {posixpath.basename(report_dir.root)}"), digest


def save(data: bytes, target: str) -> str:
    """Write `data` to `target` (a path or an fsspec URL) whole, atomically; returns where."""
    if "://" in target:
        parent, name = target.rsplit("/", 1)
    else:
        parent, name = os.path.split(os.path.abspath(target))
    folder = RunDir(parent)
    folder.makedirs()
    folder.write_atomic(name, data)
    return folder.path(name) if "://" not in target else target


def write_report(
    report_dir: RunDir, sources: list[Source], output: str | None = None
) -> tuple[str, RunDigest]:
    """Build the report and save it as `output`, else as `report.html` in `report_dir`;
    returns where, and the digest it shows."""
    data, digest = build_report(report_dir, sources)
    if output is not None:
        return save(data, output), digest
    report_dir.write_atomic(REPORT_NAME, data)
    return report_dir.path(REPORT_NAME), digest
