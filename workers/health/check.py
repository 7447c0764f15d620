"""Entry points of the health check: plan the jobs, run them here, write the reports.

A plan splits every file of every source into byte ranges (one job each); the same plan runs
in this process (`run_local`) or as a Celery chord (`--distributed`), and `combine` turns the
jobs' results into the reports either way.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

from infra import scratch as scratch_dirs
from infra.environment import from_env
from infra.store import RunDir
from schemas.errors import UsageError
from schemas.health import (
    QUALITY_SUMMARY,
    HealthPlan,
    Limits,
    ScanJob,
    ScanResult,
    Source,
    SummaryState,
)
from schemas.quality_summary import SummaryRun
from workers.health.accounting import Accounting
from workers.health.combine import combine
from workers.health.io import open_writer
from workers.health.registry import normalize_ignored
from workers.health.scan import ResultsScan, scan
from workers.health.sources import apply_overrides, discover, persisted_limits
from workers.health.summary import run_section, summary_chunks

log = logging.getLogger(__name__)

LOCAL_RANGE_BYTES = 1 << 40


def distributed_range_bytes() -> int:
    """Bytes per job of a distributed recheck (ROLLOUTS_HEALTH_RANGE_BYTES overrides 64 MiB)."""
    return from_env().health_range_bytes


def _ranges(size: int, range_bytes: int) -> list[tuple[int, int | None]]:
    if size <= range_bytes:
        return [(0, None)]
    bounds = list(range(0, size, range_bytes))
    return [(b, bounds[i + 1] if i + 1 < len(bounds) else None) for i, b in enumerate(bounds)]


def plan_jobs(
    sources: list[Source], scratch: str, ignored: list[str], range_bytes: int
) -> list[ScanJob]:
    """Byte-range jobs over every file, results files first (their order numbers positional records)."""
    jobs: list[ScanJob] = []
    for kind in ("results", "failures", "materialized"):
        for i, source in enumerate(sources):
            name = source.name if kind == "results" else getattr(source, kind)
            if name is None:
                continue
            rd = RunDir(source.dir)
            for start, end in _ranges(rd.size(name), range_bytes):
                jobs.append(
                    ScanJob(
                        scratch=scratch,
                        job=len(jobs),
                        source=i,
                        kind=kind,
                        dir=source.dir,
                        name=name,
                        label=source.label,
                        start=start,
                        end=end,
                        ignored=ignored,
                    )
                )
    return jobs


def make_plan(
    report_dir: str,
    sources: list[Source],
    *,
    ignored: list[str] | tuple[str, ...] = (),
    limits: Limits | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    scratch: str | None = None,
    range_bytes: int = LOCAL_RANGE_BYTES,
) -> HealthPlan:
    report = RunDir(report_dir)
    ignored_list = list(normalize_ignored(list(ignored)))
    scratch = scratch or f"{report.url}/.health-scratch-{uuid.uuid4().hex[:12]}"
    return HealthPlan(
        report_dir=report.url,
        scratch=scratch,
        sources=sources,
        jobs=plan_jobs(sources, scratch, ignored_list, range_bytes),
        ignored=ignored_list,
        limits=limits or Limits(),
        limit_overrides=overrides or {},
    )


def run_local(plan: HealthPlan) -> SummaryRun:
    """Every job here, one after another, then the combine step; returns the summary's `run`."""
    return combine(plan, [scan(job) for job in plan.jobs])


def plan_recheck(
    run_dir: str,
    *,
    rollouts_file: str | None = None,
    limit_overrides: dict[str, str | None] | None = None,
    ignored: list[str] | tuple[str, ...] = (),
    distributed: bool = False,
    capture_dir: str | None = None,
) -> HealthPlan:
    """The plan of `rollouts health-check RUN_DIR`: sources verified, limits resolved; the
    failed rollouts' calls are read from `capture_dir`, else from each run's own. A local plan
    owns a scratch folder (`infra/scratch.py`), removed by its combine step; a caller that does
    not run the plan removes it (`scratch_dirs.remove(plan.scratch)`)."""
    rd = RunDir(run_dir)
    if not rd.fs.isdir(rd.root):
        raise UsageError(f"run directory not found: {run_dir}")
    sources = discover(rd, rollouts_file)
    if capture_dir is not None:
        sources = [s.model_copy(update={"capture_dir": capture_dir}) for s in sources]
    limits, overrides = apply_overrides(persisted_limits(rd, sources), limit_overrides or {})
    scratch = None if distributed else _local_scratch()
    return make_plan(
        rd.url,
        sources,
        ignored=ignored,
        limits=limits,
        overrides=overrides,
        scratch=scratch,
        range_bytes=distributed_range_bytes() if distributed else LOCAL_RANGE_BYTES,
    )


def _local_scratch() -> str:
    return scratch_dirs.make("rollouts-health-")


def check_sources_here(
    report_dir: str,
    sources: list[Source],
    *,
    ignored: list[str] | tuple[str, ...] = (),
    limits: Limits | None = None,
) -> SummaryRun:
    """Check `sources` in this process and write the reports into `report_dir`."""
    scratch = _local_scratch()
    try:
        plan = make_plan(report_dir, sources, ignored=ignored, limits=limits, scratch=scratch)
        return run_local(plan)
    finally:
        scratch_dirs.remove(scratch)


class FoldedCheck:
    """A check of one shard in this process whose results are read by another pass: the finish
    step's one pass over the results (`workers/finish.py`) parses every line to count and
    aggregate it, and hands each to this check's results job (`add_parsed`, `end`) instead of
    the job reading and parsing the file again. The other jobs (failures, inventory) and the
    combine step run in `run`.

    It never fails the pass that feeds it: an error of the job is kept, and `run` then reads the
    results itself, as does a pass that did not reach the end of the file. A context manager:
    the scratch folder goes when the block exits.
    """

    def __init__(self, rd: RunDir, name: str, ignored: list[str] | tuple[str, ...] = ()) -> None:
        self.rd = rd
        self.ignored = list(ignored)
        self.scratch = _local_scratch()
        source = Source(label=name, dir=rd.url, name=name)
        self.job = plan_jobs(
            [source], self.scratch, list(normalize_ignored(self.ignored)), LOCAL_RANGE_BYTES
        )[0]
        self._scan = ResultsScan(self.job)
        self._stack = contextlib.ExitStack()
        self._ended = False
        self._failed: BaseException | None = None

    def __enter__(self) -> FoldedCheck:
        try:
            self._stack.enter_context(self._scan)
        except Exception as exc:
            self._failed = exc
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._close(clean=False)  # not run: nothing of the job's is kept
        finally:
            scratch_dirs.remove(self.scratch)

    def _close(self, clean: bool) -> ScanResult | None:
        """End the job's scan: its result when `clean` and it ends well, else None (its late
        run, open until now, is discarded)."""
        try:
            if clean:
                self._stack.close()
                return self._scan.result
            self._stack.__exit__(_Abandoned, _Abandoned(), None)
        except Exception as exc:
            self._failed = self._failed or exc
        return None

    def add_parsed(self, offset: int, line: bytes | memoryview, value: Any) -> None:
        if self._failed is None:
            try:
                self._scan.add_parsed(offset, line, value)
            except Exception as exc:
                self._failed = exc

    def end(self, position: int) -> None:
        if self._failed is None:
            try:
                self._scan.end(position)
                self._ended = True
            except Exception as exc:
                self._failed = exc

    def run(self, sources: list[Source], limits: Limits) -> SummaryRun:
        """Check `sources` (the shard's, read after the pass: its status is written by then) and
        write the reports beside them; returns the summary's `run`."""
        plan = make_plan(
            self.rd.url, sources, ignored=self.ignored, limits=limits, scratch=self.scratch
        )
        usable = self._failed is None and self._ended and plan.jobs[0] == self.job
        fed = self._close(clean=usable)  # the job's late run is complete only now
        if fed is None:  # a broken feed's runs are not in the plan's results: no harm
            log.warning(
                "the health check of %s reads the results again: %s",
                self.rd.path(self.job.name),
                self._failed
                or ("its plan reads them in parts" if self._ended else "the pass stopped short"),
            )
            return run_local(plan)
        return combine(plan, [fed, *(scan(job) for job in plan.jobs[1:])])


class _Abandoned(Exception):
    """Thrown into a fed results scan that is not used: its files are discarded."""


def write_disabled(
    report_dir: str,
    sources: list[str],
    ignored: list[str],
    limits: Limits,
    coverage_of: list[Source] | None = None,
) -> SummaryRun:
    """The summary of a run with `disable_health_check`: state disabled, nothing counted."""
    return write_summary(
        RunDir(report_dir), "disabled", limits, sources, ignored, coverage_of=coverage_of
    )


def write_summary(
    rd: RunDir,
    state: SummaryState,
    limits: Limits,
    sources: list[str],
    ignored: list[str],
    *,
    accounting: Accounting | None = None,
    check: tuple[str, str | None, list[dict[str, Any]]] | None = None,
    coverage_of: list[Source] | None = None,
) -> SummaryRun:
    """Write a summary whose records were not read (provisional, disabled); returns its `run`."""
    run = run_section(
        state=state,
        totals=None,
        accounting=accounting,
        limits=limits,
        overrides={},
        sources=sources,
        ignored=ignored,
        check=check,
        coverage_of=coverage_of,
    )
    with open_writer(rd, QUALITY_SUMMARY) as f:
        for chunk in summary_chunks(run, ()):
            f.write(chunk)
    return run
