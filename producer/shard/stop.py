"""Stopping `rollouts run` on SIGTERM: stop the shard's rollouts, write the provisional summary
and coverage, and end with exit 75 when a resume can complete what was saved.

A cluster scheduler sends SIGTERM and kills the job a little later; the summary must be on
storage before that, so it is the accounting alone (see workers/health/provisional.py), and so
is the coverage (`stopped_coverage`: Redis and the sidecar, no result row read).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from rich.console import Console

from infra import generation, keys
from infra.environment import from_env
from infra.redis_client import client
from infra.runs import read_manifest
from infra.store import ShardFiles
from producer.shard.opening import OpenedRun
from schemas import fields as F
from schemas.coverage import RunCoverage
from schemas.errors import RunFailedError, RunPartialError
from schemas.health import QUALITY_SUMMARY, STOPPED_BY_SIGTERM
from schemas.settings import CollectionSettings
from workers.finish import settings_limits
from workers.health.provisional import write_provisional
from workers.health.sources import source_for
from workers.shard.coverage import RecoveryPolicy, stopped_coverage, write_coverage
from workers.shard.reservations import Reservations

log = logging.getLogger(__name__)


class Stopped(BaseException):
    """Raised in the main thread when `rollouts run` receives SIGTERM."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises Stopped (a scheduler stopping the job) instead of killing us."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def counted(
    rows: Iterator[dict[str, Any]],
    groups: Counter[tuple[str | None, str | None]],
    on_end: Callable[[Counter[tuple[str | None, str | None]]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Count the rollouts per (agent, environment server) as they are enqueued; `on_end` gets
    the counts once every row was."""
    for row in rows:
        env = row.get(F.ENVIRONMENT_SERVER)
        groups[(F.agent_name(row), env if isinstance(env, str) else None)] += 1
        yield row
    if on_end is not None:
        on_end(groups)


SETTLE_S = 2.5


def _settle(redis_url: str, opened: OpenedRun) -> None:
    """Wait (briefly) until landing stops: in-flight rollouts see the stop flag and are cancelled."""
    r = client(redis_url)
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    deadline = time.monotonic() + SETTLE_S
    last, stable_since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = r.hgetall(keys.shard_counts(sid))
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 0.6:
            return
        time.sleep(0.1)


def stop_run(
    opened: OpenedRun,
    redis_url: str,
    groups: Counter[tuple[str | None, str | None]] | None,
    console: Console,
) -> RunFailedError:
    """Stop the shard's rollouts, write the coverage and the provisional summary (which points
    at it); returns the error to raise."""
    r = client(redis_url)
    shard = opened.manifest.shard
    sid = keys.shard_id(opened.rd.url, shard)
    r.set(keys.shard_run_failed(sid), STOPPED_BY_SIGTERM, nx=True, ex=from_env().live_key_ttl_s)
    _settle(redis_url, opened)
    settings = CollectionSettings.model_validate(opened.manifest.settings)
    coverage: RunCoverage | None = None
    manifest = opened.manifest
    try:
        manifest = read_manifest(opened.rd, shard)
        coverage = stopped_coverage(r, opened.rd, manifest, RecoveryPolicy.of(settings))
        write_coverage(opened.rd, coverage)
    except Exception:  # the coverage must not hide the stop itself
        log.exception("could not write the coverage of %s", opened.rd.url)
    where = opened.rd.path(QUALITY_SUMMARY)
    results = ShardFiles(shard).results
    try:
        run = write_provisional(
            opened.rd,
            shard,
            r,
            planned=opened.manifest.planned,
            group_owed=groups,
            limits=settings_limits(settings),
            ignored=settings.health_check_ignored_checks,
            reserved=Reservations(manifest.generations),
            coverage_of=[source_for(opened.rd, results, results)] if coverage else None,
        )
    except Exception as exc:  # a report must not hide the stop itself
        log.exception("could not write the provisional summary of %s", opened.rd.url)
        return RunFailedError(f"the run was stopped by SIGTERM; no provisional summary: {exc}")
    acc = run["accounting"]
    console.print(
        f"stopped by SIGTERM: landed {acc['landed']}/{acc['owed']}, failed "
        f"{acc['failed']['total']}; provisional quality summary: {where}"
    )
    message = f"the run was stopped by SIGTERM; provisional summary at {where}"
    if coverage is None:
        return RunFailedError(message)
    done = generation.read(r, sid).count(generation.DONE)
    if coverage.runnable and done:
        return RunPartialError(
            f"{message}; {coverage.runnable} rollouts can still run: `rollouts resume "
            f"{opened.rd.url} --shard {shard}` completes it (exit 75: requeue it)"
        )
    return RunFailedError(message)
