"""The combine step: key the late records, merge every job's runs, write both reports.

It is the same code whether the jobs ran in this process or as Celery jobs across the cluster,
and its output depends only on the sorted entries, so the two give identical reports.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson

from infra import scratch as scratch_dirs
from infra.store import RunDir
from schemas.health import (
    QUALITY_SUMMARY,
    ROLLOUT_VERDICTS,
    RUN_CHECK,
    FileKind,
    HealthPlan,
    ScanJob,
    ScanResult,
)
from schemas.quality_summary import SummaryRun
from schemas.run_facts import InputDigest
from workers.health.accounting import Accounting, SourceCounts, excessive_failures
from workers.health.digest import CHECK_NUMBER, POSITIONAL
from workers.health.io import file_digest, iter_scratch, open_writer
from workers.health.reduce import Reducer, Totals
from workers.health.scan import KEY_LEN, RECORD
from workers.health.spool import RunWriter, merge, tagged
from workers.health.summary import config_section, run_section, summary_chunks
from workers.health.timeouts import Timeouts
from workers.shard.reservations import Reservations

log = logging.getLogger(__name__)
UNREADABLE_NUMBER = CHECK_NUMBER["record_unreadable"]


def _key_late(plan: HealthPlan, results: dict[int, ScanResult], scratch: RunDir) -> list[str]:
    """Give positional records their identity: the global ordinal, or their line number."""
    writer = RunWriter(scratch, "late", KEY_LEN)
    line_base: dict[tuple[int, str], int] = {}
    ordinal_base = 0
    for job in plan.jobs:
        if job.kind != "results":
            continue
        result = results[job.job]
        base = line_base.get((job.source, job.name), 0)
        if result.late is not None:
            for raw in iter_scratch(scratch, result.late):
                if not raw:
                    continue
                rel_line, rel_ordinal, offset, rt, rv, st, sv, payload = orjson.loads(raw)
                line_no = base + rel_line
                flags = payload[3]
                if flags & 16:
                    task: Any = f"__unreadable_record__:input-{job.source}:line-{line_no}"
                    for finding in payload[2]:
                        if finding[0] == UNREADABLE_NUMBER:
                            finding[1] = {"source_file": job.label, "line": line_no}
                else:
                    task = ordinal_base + rel_ordinal
                payload[3] = flags | POSITIONAL
                writer.add([job.source, *tagged(task), rt, rv, RECORD, st, sv, offset, payload])
        line_base[(job.source, job.name)] = base + result.lines
        ordinal_base += result.nonblank
    return writer.close()


def input_digests(plan: HealthPlan, results: dict[int, ScanResult]) -> list[InputDigest]:
    """The size and SHA-256 of every file the jobs read, in plan order: from the one job that
    read a file whole, else read again here (a file split into byte ranges)."""
    jobs: dict[tuple[int, FileKind], list[ScanJob]] = {}
    for job in plan.jobs:
        jobs.setdefault((job.source, job.kind), []).append(job)
    out = []
    for (source, kind), parts in jobs.items():
        first = results[parts[0].job]
        if len(parts) == 1 and first.sha256 is not None and first.size is not None:
            size, sha = first.size, first.sha256
        else:
            size, sha = file_digest(RunDir(parts[0].dir), parts[0].name)
        label = plan.sources[source].label
        out.append(InputDigest(source=label, kind=kind, bytes=size, sha256=sha))
    return out


def combine(plan: HealthPlan, results: list[ScanResult]) -> SummaryRun:
    """Write `rollout_verdicts.jsonl` and `quality_summary.json`; returns the summary's `run`."""
    scratch = RunDir(plan.scratch)
    try:
        return _combine(plan, {r.job: r for r in results}, scratch)
    finally:
        with contextlib.suppress(FileNotFoundError, OSError):
            scratch.fs.rm(scratch.root, recursive=True)
        scratch_dirs.release(plan.scratch)  # a local one's lock (`infra/scratch.py`)


def _combine(plan: HealthPlan, results: dict[int, ScanResult], scratch: RunDir) -> SummaryRun:
    names = [n for job in plan.jobs for n in results[job.job].runs]
    names += _key_late(plan, results, scratch)
    accounting = Accounting(
        [
            SourceCounts(s.materialized is not None, s.drained, s.rate_limit_waits, s.tokens)
            for s in plan.sources
        ]
    )
    totals = Totals(frozenset(plan.ignored))
    multi = len(plan.sources) > 1
    tasks = RunWriter(scratch, "tasks", 3)

    def emit(source: int, task: Any, entry: dict[str, Any]) -> None:
        label = f"{plan.sources[source].label}:{task}" if multi else str(task)
        tasks.add([source if multi else 0, tagged(task)[0], str(task), label, entry])

    report = RunDir(plan.report_dir)
    labels = [s.label for s in plan.sources] if multi else None
    timeouts = Timeouts([s.capture_dir for s in plan.sources])
    with open_writer(report, ROLLOUT_VERDICTS) as out:
        reserved = [Reservations(s.generations) if s.generations else None for s in plan.sources]
        reducer = Reducer(accounting, totals, out, emit, labels, timeouts, reserved)
        reducer.run(merge(scratch, names, KEY_LEN))
    check = excessive_failures(accounting, plan.limits, RUN_CHECK in plan.ignored)
    run = run_section(
        state="complete",
        totals=totals,
        accounting=accounting,
        limits=plan.limits,
        overrides=plan.limit_overrides,
        sources=[s.label for s in plan.sources],
        ignored=plan.ignored,
        check=check,
        config=config_section([(s.label, s.config_facts) for s in plan.sources]),
        inputs=input_digests(plan, results),
        timeouts=timeouts.section(),
        coverage_of=plan.sources,
    )
    task_entries = ((e[3], e[4]) for e in merge(scratch, tasks.close(), 3, prefix="tasks-merge"))
    with open_writer(report, QUALITY_SUMMARY) as f:
        for chunk in summary_chunks(run, task_entries):
            f.write(chunk)
    return run
