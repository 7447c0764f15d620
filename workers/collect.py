"""One rollout, start to finish: admit it, call the agent, sort what came back, land it, free the slot.

Nothing here raises for a rollout's own trouble: a task that raised would fail the whole chord
and the shard would never finish. Every path returns a small summary for the chord instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import redis

from infra import keys
from infra.http import process_io
from infra.redis_client import client
from schemas import fields as F
from schemas.errors import ShardFencedError, StorageError, TransientError
from schemas.messages import CollectRequest
from schemas.records import FailureRow
from workers.admission import Gate, Ticket, gate, with_redis_retry
from workers.agent_call import CallOutcome, call_run, failure_row
from workers.landing import LandReport, lander

log = logging.getLogger(__name__)

STOP_POLL_S = 0.5
LAND_RETRY_S = 120.0


def _summary(planned: dict[str, Any], outcome: str, **extra: Any) -> dict[str, Any]:
    return {"rollout": F.rollout_id(planned), "outcome": outcome, **extra}


def sort_outcome(outcome: CallOutcome) -> tuple[dict[str, Any] | None, list[dict[str, Any]], str]:
    """(result for rollouts-S.jsonl, rows for the sidecar, a one-word outcome)."""
    failures = list(outcome.failures)
    result = outcome.result
    if result is not None:
        if result.get(F.NO_PERSIST):
            return None, failures, "not_persisted"
        if result.get(F.FAILURE_CLASS) is not None:
            failures.append(result)
            return None, failures, "agent_failure"
        return result, failures, "landed"
    assert outcome.final_failure is not None
    failures.append(outcome.final_failure)
    return None, failures, "failed"


def drained_row(row: dict[str, Any], message: str) -> dict[str, Any]:
    """What a rollout that never started resolves to (SPEC §5); it lands nowhere."""
    return {
        **{k: row[k] for k in F.IDENTITY_FIELDS if k in row},
        F.FAILURE_CLASS: "cancelled",
        F.NO_PERSIST: True,
        F.DISPATCH_DRAINED: True,
        "error_message": message,
    }


def not_started_message(g: Gate, req: CollectRequest, ticket: Ticket) -> str:
    if ticket.verdict == "failed":
        return f"not dispatched: the run failed: {ticket.detail}"
    if ticket.verdict == "cancelled":
        return "not dispatched: the run is " + (
            "draining" if ticket.detail == "drain" else "cancelled"
        )
    remaining = float(ticket.detail)
    margin = g.margin_s(ticket.sid, req)
    if remaining <= 0 or margin is None:
        return "not dispatched: dispatch budget exhausted"
    return (
        f"not dispatched: {remaining:.0f}s left in dispatch budget, "
        f"below the {margin:.0f}s drain margin"
    )


def worker_lost_row(req: CollectRequest, deaths: int) -> dict[str, Any]:
    failure = FailureRow(
        _ng_failure_class="worker_lost",
        _ng_failure_type="WorkerLost",
        _ng_failure_message=(
            f"the worker running this rollout died {deaths} times "
            f"(attempt limit {req.policy.max_attempts}); not delivered to the agent again"
        ),
        _ng_failure_terminal=True,
        failure_kind="kill_shaped",
    )
    return failure_row(req.row, failure)


def land(
    req: CollectRequest,
    redis_url: str,
    result: dict[str, Any] | None,
    failures: list[dict[str, Any]],
) -> LandReport:
    """Land the records, riding out a Redis restart or a busy lock."""
    deadline = time.monotonic() + LAND_RETRY_S
    delay = 0.5
    while True:
        try:
            return lander(redis_url).land(req.run, result, failures)
        except (redis.ConnectionError, redis.TimeoutError, TransientError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("landing %s: %s; retrying in %.1fs", F.rollout_id(req.row), exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def call_until_done_or_stopped(
    g: Gate, req: CollectRequest, sid: str
) -> tuple[CallOutcome | None, str | None]:
    """Run the `/run` call; cancel it (closing its connection) if the run is failed or cancelled."""
    io = process_io()
    future = io.loop.submit(call_run(io.http, req.agent_url, req.row, req.policy))
    while True:
        try:
            return future.result(timeout=STOP_POLL_S), None
        except concurrent.futures.TimeoutError:
            reason = g.stop_reason(sid)
            if reason is not None and reason != "drain":
                future.cancel()
                return None, reason


def fail_run(redis_url: str, sid: str, row: dict[str, Any], final: dict[str, Any]) -> None:
    """Record the run's first error (route_failures_to_sidecar off): nothing new starts after it."""
    message = (
        f"rollout {F.rollout_id(row)} failed: {final.get(F.FAILURE_CLASS)}: "
        f"{final.get(F.FAILURE_MESSAGE)}"
    )
    with_redis_retry(
        "run failure flag",
        lambda: client(redis_url).set(keys.shard_run_failed(sid), message, nx=True),
    )


def collect(req: CollectRequest, redis_url: str) -> dict[str, Any]:
    """Run one rollout and land its records; returns a small summary for the chord."""
    try:
        return _collect(req, redis_url)
    except Exception as exc:
        # A task that raised would fail the chord: the shard would never finish. The rollout is
        # left without an outcome instead (resume runs it) and the error is logged.
        log.exception("rollout %s: unexpected error", F.rollout_id(req.row))
        return _summary(req.row, "error", error=f"{type(exc).__name__}: {exc}")


def _collect(req: CollectRequest, redis_url: str) -> dict[str, Any]:
    row = req.row
    sid = keys.shard_id(req.run.output_dir, req.run.shard)
    g = gate(redis_url)
    try:
        ticket = g.admit(req, sid)
    except redis.RedisError as exc:
        log.error("rollout %s not started: Redis unavailable: %s", F.rollout_id(row), exc)
        return _summary(row, "error", error=str(exc))
    if ticket.verdict == "landed":
        return _summary(row, "duplicate")
    if ticket.verdict == "fenced":
        log.warning(
            "rollout %s not started: shard %s of %s was opened by another writer (%s) since "
            "this task's writer (%s)",
            F.rollout_id(row), req.run.shard, req.run.output_dir, ticket.detail, req.run.token,
        )  # fmt: skip
        return _summary(row, "fenced")
    if ticket.verdict in ("drained", "failed", "cancelled"):
        return _summary(row, "drained", row=drained_row(row, not_started_message(g, req, ticket)))
    if ticket.verdict == "lost":
        return _land_and_report(
            req, redis_url, sid, None, [worker_lost_row(req, int(ticket.detail))], "failed", 0
        )

    started = time.monotonic()
    try:
        outcome, stopped = call_until_done_or_stopped(g, req, sid)
    except BaseException:
        g.release(ticket, req.run.token)
        raise
    if outcome is None:
        g.release(ticket, req.run.token, field="cancelled")
        return _summary(row, "cancelled", reason=stopped)
    duration = time.monotonic() - started
    # The slot covers the /run call: the next rollout may start while this one lands.
    g.free_slot(ticket, req.run.token)
    result, failures, word = sort_outcome(outcome)
    try:
        summary = _land_and_report(
            req, redis_url, sid, result, failures, word, outcome.requests_sent
        )
    finally:
        landed = word == "landed" and req.admission.dispatch_deadline is not None
        g.release(ticket, req.run.token, duration_s=duration if landed else None)
    return summary


def _land_and_report(
    req: CollectRequest,
    redis_url: str,
    sid: str,
    result: dict[str, Any] | None,
    failures: list[dict[str, Any]],
    word: str,
    requests: int,
) -> dict[str, Any]:
    row = req.row
    try:
        report = land(req, redis_url, result, failures)
    except ShardFencedError as exc:
        log.warning("%s", exc)
        return _summary(row, "fenced")
    except (StorageError, OSError, redis.RedisError, TransientError) as exc:
        log.error("rollout %s could not be landed: %s", F.rollout_id(row), exc)
        return _summary(row, "error", error=str(exc))
    if word == "failed" and not req.policy.route_failures_to_sidecar:
        fail_run(redis_url, sid, row, failures[-1])
    if report.duplicate:
        word = "duplicate"
    return _summary(row, word, requests=requests)
