"""A shard's finish step: aggregate metrics per environment server, final status, health, manifest.

The health check runs at the end of every run (also a failed one: its partial results are
judged; a run stopped by SIGTERM keeps the provisional summary written when it stopped); it never
fails the run: an error in it is logged and reported, and the run's state stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from types import SimpleNamespace
from typing import Any

import redis

from infra import generation, keys
from infra.feed import close_feed, feed_status
from infra.locks import held
from infra.redis_client import client
from infra.runs import read_manifest, recorded_finish, write_manifest, write_status
from infra.store import RunDir, ShardFiles
from infra.telemetry import TRACEPARENT
from schemas.config import ServersConfig
from schemas.errors import RunPartialError
from schemas.finish import FinishResult
from schemas.health import QUALITY_SUMMARY, STOPPED_BY_SIGTERM, Limits
from schemas.messages import RunRef
from schemas.quality_summary import HealthBrief, HealthError, SummaryRun
from schemas.records import (
    Finished,
    ShardStatus,
    rate_limit_waits,
)
from schemas.settings import CollectionSettings
from workers import tracing
from workers.finish_ahead import (
    Abandoned,
    ReadAhead,
    ask_to_finish,
    register,
    wait_for_reader,
)
from workers.finish_pass import (
    ShardFacts,
    ShardPass,
    count_and_aggregate,
    count_only,
    members_at_finish,
    write_aggregate_file,
)
from workers.health.check import FoldedCheck, check_sources_here, write_disabled
from workers.health.sources import source_for
from workers.health.summary import blind_checks
from workers.report import write_report
from workers.report.build import FoldedReport
from workers.shard.coverage import superseded_count, write_coverage
from workers.shard.ledger import ShardLedger
from workers.shard.state import compact_shard, expire_shard_keys, shard_counts
from workers.tracing import step

__all__ = [
    "finish_ahead",
    "finish_shard",
    "health_brief",
    "settings_limits",
    "write_aggregate_file",
]

log = logging.getLogger(__name__)


def settings_limits(settings: CollectionSettings) -> Limits:
    return Limits(
        max_failed_rollouts=settings.max_failed_rollouts,
        max_failed_fraction=settings.max_failed_fraction,
    )


def health_brief(run: SummaryRun, path: str) -> HealthBrief:
    """The part of a summary a caller prints: state, verdict, reasons, verdict counts, the
    timeouts section, and the checks no record had the evidence for (what the unobserved count
    means)."""
    return {
        "state": run["state"],
        "healthy": run["healthy"],
        "reasons": run["reasons"],
        "verdicts": run["verdicts"],
        "ignored_checks": run["ignored_checks"],
        "timeouts": run["timeouts"],
        "path": path,
        "blind_checks": blind_checks(run),
    }


def check_shard_health(
    rd: RunDir,
    shard: str,
    settings: CollectionSettings,
    folded: FoldedCheck | None = None,
    status: ShardStatus | None = None,
) -> HealthBrief | HealthError:
    """Write the shard's quality summary (or the disabled one); never raises. `folded`: the
    check whose results scan the finish step's pass fed; `status`: the shard's status, when
    the check runs before it is written (else it is read beside the results)."""
    files = ShardFiles(shard)
    path = rd.path(QUALITY_SUMMARY)
    with step("rollouts.health_check", **{"rollouts.shard": shard}) as traced:
        brief = _check_shard_health(rd, shard, settings, files, path, folded, status)
        if "error" in brief:
            traced.fail(str(brief["error"]))
        else:
            traced.set("rollouts.health.state", brief["state"])
        return brief


def _check_shard_health(
    rd: RunDir,
    shard: str,
    settings: CollectionSettings,
    files: ShardFiles,
    path: str,
    folded: FoldedCheck | None,
    status: ShardStatus | None,
) -> HealthBrief | HealthError:
    doc = None if status is None else status.model_dump(mode="json")
    try:
        if settings.disable_health_check:
            run = write_disabled(
                rd.url,
                [files.results],
                settings.health_check_ignored_checks,
                settings_limits(settings),
                coverage_of=[source_for(rd, files.results, files.results, doc)],
            )
        elif folded is not None:
            sources = [source_for(rd, files.results, files.results, doc)]
            run = folded.run(sources, settings_limits(settings))
        else:
            run = check_sources_here(
                rd.url,
                [source_for(rd, files.results, files.results, doc)],
                ignored=settings.health_check_ignored_checks,
                limits=settings_limits(settings),
            )
    except Exception as exc:  # a report must not stop the run
        log.exception("health check of %s shard %s failed; the run is not affected", rd.url, shard)
        return {"error": f"{type(exc).__name__}: {exc}", "path": path}
    return health_brief(run, path)


def write_shard_report(
    rd: RunDir,
    shard: str,
    ledger: ShardLedger | None = None,
    folded: FoldedReport | None = None,
) -> str | None:
    """Write the shard's `report.html` beside its quality summary; returns where, or None when
    it failed: a report failure is logged and never fails the shard. `folded`: the report the
    finish step's pass fed, with that pass's `ledger`."""
    results = ShardFiles(shard).results
    try:
        source = source_for(rd, results, results)
        if folded is not None and ledger is not None:
            return folded.write(ledger, source)
        return write_report(rd, [source])[0]
    except Exception:  # a report must not stop the run
        log.exception("report of %s shard %s failed; the run is not affected", rd.url, shard)
        return None


def _folded_report(rd: RunDir, results: str) -> FoldedReport | None:
    """The report the finish step's pass feeds, or None when it cannot start (the report is
    then built by itself, or its failure logged, after the pass)."""
    try:
        return FoldedReport(rd, results)
    except Exception as exc:
        log.warning("the report of %s will read the results again: %s", rd.url, exc)
        return None


def finish_shard(run: RunRef, redis_url: str) -> FinishResult:
    """Finish a shard after its last rollout task returned; when a worker read its results ahead
    (`workers/finish_ahead.py`), wait for it to end the step and return what it recorded."""
    finished = finished_ahead(run, redis_url)
    return finished if finished is not None else finish_here(run, redis_url)


def finished_ahead(run: RunRef, redis_url: str) -> FinishResult | None:
    """Ask the worker reading the shard ahead, if one is, to end the finish step now and wait
    for it; the result it recorded, or None when the step is still to do (no reader, or one
    that stopped short)."""
    rd = RunDir(run.output_dir)
    r = client(redis_url)
    ask_to_finish(r, run)
    if not wait_for_reader(r, keys.shard_id(rd.url, run.shard), run.token):
        return None
    manifest = read_manifest(rd, run.shard)
    return recorded_finish(rd, manifest, run.token)


def finish_here(run: RunRef, redis_url: str) -> FinishResult:
    """The finish step in this thread (it returns the result recorded for the generation, if a
    finish recorded one already)."""
    rd = RunDir(run.output_dir)
    sid = keys.shard_id(rd.url, run.shard)
    # Held while finishing: one finish of a shard at a time, and a sign of life to the producer.
    with held(client(redis_url), keys.shard_finishing(sid)):
        return _finish(rd, sid, run, redis_url)


def finish_ahead(
    run: RunRef, redis_url: str, r: redis.Redis, signature: dict[str, Any]
) -> FinishResult:
    """The finish step run ahead by the worker thread that holds the shard's reader lock: its
    pass reads the results as they land, and the step ends once the generation settled (raises
    `Abandoned` when it stops short). `signature`: the generation's finish task, whose trace
    parent (the job span, when traced) its spans take."""
    rd = RunDir(run.output_dir)
    sid = keys.shard_id(rd.url, run.shard)
    ahead = ReadAhead(r, rd, sid, run.token)
    headers = (signature.get("options") or {}).get("headers") or {}
    request = SimpleNamespace(**{TRACEPARENT: headers.get(TRACEPARENT)})
    payload = (signature.get("args") or [{}])[0]
    with tracing.finishing(request, payload), contextlib.ExitStack() as stack:
        result = _finish_in(rd, sid, run, redis_url, stack, ahead)
    if ahead.settled_at is not None:
        log.info(
            "%s shard %s finished %.2fs after its generation settled (%d result lines read ahead)",
            rd.url,
            run.shard,
            time.monotonic() - ahead.settled_at,
            ahead.ahead_lines,
        )
    return result


register(finish_ahead)


def _finish(rd: RunDir, sid: str, run: RunRef, redis_url: str) -> FinishResult:
    with contextlib.ExitStack() as stack:
        return _finish_in(rd, sid, run, redis_url, stack)


def _finish_in(
    rd: RunDir,
    sid: str,
    run: RunRef,
    redis_url: str,
    stack: contextlib.ExitStack,
    ahead: ReadAhead | None = None,
) -> FinishResult:
    manifest = read_manifest(rd, run.shard)
    if manifest.token != run.token:
        log.warning(
            "finish of %s shard %s skipped: superseded by a later dispatch", rd.url, run.shard
        )
        return FinishResult(state="superseded")
    config = ServersConfig.model_validate(manifest.config)
    settings = CollectionSettings.model_validate(manifest.settings)
    r = client(redis_url)
    results = ShardFiles(run.shard).results
    feed = None
    run_error: str | None = None
    cancelled: str | None = None
    shard = ShardFacts.of(rd, manifest, settings)

    def close() -> None:
        """From here nothing lands in the shard: it is closed, its feed too, and what stopped
        the run (its first error, a cancel) is read. Read ahead, the step takes the finishing
        lock here and reads the manifest again (the producer may have written it since)."""
        nonlocal manifest, feed, run_error, cancelled
        if ahead is not None:
            stack.enter_context(held(r, keys.shard_finishing(sid)))
            manifest = read_manifest(rd, run.shard)
            if manifest.token != run.token:
                raise Abandoned("the generation was superseded")
            if recorded_finish(rd, manifest, run.token) is not None:
                raise Abandoned("a finish task finished it")
            # Written while the rollouts landed: the records a newer attempt superseded.
            shard.manifest = manifest
            shard.facts = dataclasses.replace(
                shard.facts, superseded=superseded_count(rd, run.shard)
            )
        # Every appended file becomes one object before anything reads it for the reports:
        # after a run finishes, any JSONL reader reads it.
        compact_shard(r, rd, run.shard, close=True)
        if settings.feed is not None:  # nothing lands any more: its readers end once caught up
            close_feed(r, settings.feed, sid)
            feed = feed_status(r, settings.feed)
        if not rd.exists(results):
            # Nothing landed: NeMo Gym's readers (`gym eval health-check`) still expect the file.
            rd.write_atomic(results, b"")
        failed_raw, cancel_raw = r.mget(keys.shard_run_failed(sid), keys.shard_cancel(sid))
        run_error = failed_raw.decode() if isinstance(failed_raw, bytes) else None
        cancelled = cancel_raw.decode() if isinstance(cancel_raw, bytes) else None

    if ahead is None:
        standing = recorded_finish(rd, manifest, run.token)
        if standing is not None:  # read ahead and finished by a worker, or a redelivery
            return standing
        close()
    elif settings.disable_aggregation:
        raise Abandoned("no pass to read ahead (disable_aggregation)")

    health: HealthBrief | HealthError | None = None
    # The health check's scan of the results and the report ride on the counting's pass (one
    # parse of each row, not three) when they will run.
    folded = None
    checking = not (settings.disable_aggregation or settings.disable_health_check)
    if checking and (ahead is not None or run_error != STOPPED_BY_SIGTERM):
        ignored = settings.health_check_ignored_checks
        folded = stack.enter_context(FoldedCheck(rd, results, ignored))
    reporting = None
    if settings.write_report and not settings.disable_aggregation:
        reporting = _folded_report(rd, results)
    status: ShardStatus | None = None

    def counted(done: ShardPass) -> None:
        """The shard's coverage, its status but for the members' aggregation, and its health
        check: what needs the pass's accounting and not the servers' answers, done while the
        servers are asked (their aggregate can take seconds on a large shard)."""
        nonlocal health, status
        counts = done.ledger
        write_coverage(rd, done.coverage)
        current = generation.read(r, sid)
        ours = current if current.token == run.token else generation.Generation()
        status = counts.status(manifest.run_id, run.shard)
        status.drained = ours.count(generation.DRAINED)
        status.cancelled = ours.count(generation.CANCELLED)
        status.stopped = ours.count(generation.STOPPED)
        status.rate_limit_waits = rate_limit_waits(shard_counts(r, sid))
        status.tokens = counts.tokens.usage(settings.model_prices)
        status.feed = feed
        if run_error == STOPPED_BY_SIGTERM:
            # The provisional summary written at the stop stays until `rollouts health-check`.
            log.info("%s shard %s was stopped: its provisional summary is kept", rd.url, run.shard)
        elif not settings.disable_aggregation:
            health = check_shard_health(rd, run.shard, settings, folded, status)

    if settings.disable_aggregation:
        done = count_only(rd, shard)
        counted(done)
    else:
        done = count_and_aggregate(
            rd,
            shard,
            config,
            watchers=tuple(w for w in (folded, reporting) if w is not None),
            on_landed=reporting.landed if reporting is not None else None,
            counted=counted,
            ahead=ahead,
            on_settled=close,
        )
    counts, run_coverage = done.ledger, done.coverage
    assert status is not None, "the pass calls counted once its rows are read"
    status.members = members_at_finish(counts, shard.policy, settings, done)
    rejection = str(done.rejection) if done.rejection is not None else None
    write_status(rd, status)

    manifest.state = "failed" if run_error else "cancelled" if cancelled else "completed"
    manifest.error = run_error
    if cancelled and not run_error:
        manifest.error = "cancelled with --drain" if cancelled == "drain" else "cancelled"
    if done.error and not manifest.error:
        manifest.error = f"aggregation failed: {done.error}"
    if rejection is not None:
        manifest.state = "failed"
        manifest.error = f"{manifest.error}; {rejection}" if manifest.error else rejection
    write_manifest(rd, manifest)
    report = None
    if settings.write_report:
        report = write_shard_report(rd, run.shard, counts, reporting)
    progress = shard.progress(counts)
    resumable = isinstance(done.rejection, RunPartialError)
    # A failed run (its first error) or a hard cancel ends the chain: exit 1, not 75.
    failed = run_error not in (None, STOPPED_BY_SIGTERM) or cancelled == "cancel"
    stopped_early = not failed and (
        status.drained > 0 or cancelled == "drain" or run_error == STOPPED_BY_SIGTERM or resumable
    )
    result = FinishResult(
        state=manifest.state,
        error=manifest.error,
        run_error=run_error,
        cancelled=cancelled,
        rejection=rejection,
        partial=stopped_early and progress and run_coverage.runnable > 0,
        progress=progress,
        landed=counts.landed,
        planned=counts.planned,
        failed=dict(counts.failed),
        drained=status.drained,
        stopped=status.stopped,
        aggregation_error=done.error,
        health=health,
        coverage=done.metrics,
        run_coverage=run_coverage,
        report=report,
    )
    files = ShardFiles(run.shard)
    manifest.finished = Finished(
        token=run.token,
        results_bytes=rd.size(files.results),
        failures_bytes=rd.size(files.failures),
        result=result,
    )
    write_manifest(rd, manifest)  # after the report, which reads the state written above
    expire_shard_keys(r, sid, settings.redis_key_ttl_s, run.token)
    return result
