"""One rollout, start to finish: call the agent, sort what came back into records, land them."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

from infra import keys
from infra.http import process_io
from infra.redis_client import client
from schemas import fields as F
from schemas.errors import ShardFencedError
from schemas.messages import CollectRequest
from workers.agent_call import CallOutcome, call_run
from workers.landing import lander

log = logging.getLogger(__name__)

STOP_POLL_S = 0.5


class _StopFlags:
    """Whether a shard's run has stopped (failed or cancelled), read from Redis at most every half second."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, str | None]] = {}

    def reason(self, redis_url: str, sid: str) -> str | None:
        now = time.monotonic()
        cached = self._seen.get(sid)
        if cached is not None and now - cached[0] < STOP_POLL_S:
            return cached[1]
        raw = client(redis_url).get(keys.shard_run_failed(sid))
        value = raw.decode() if isinstance(raw, bytes) else None
        with self._lock:
            self._seen[sid] = (now, value)
        return value


stop_flags = _StopFlags()


def _summary(row: dict[str, Any], outcome: str, **extra: Any) -> dict[str, Any]:
    return {"rollout": F.rollout_id(row), "outcome": outcome, **extra}


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


def collect(req: CollectRequest, redis_url: str) -> dict[str, Any]:
    """Run one rollout and land its records; returns a small summary for the chord."""
    row = req.row
    sid = keys.shard_id(req.run.output_dir, req.run.shard)
    if stop_flags.reason(redis_url, sid) is not None:
        return _summary(row, "skipped")
    io = process_io()
    future = io.loop.submit(call_run(io.http, req.agent_url, row, req.policy))
    while True:
        try:
            outcome = future.result(timeout=STOP_POLL_S)
            break
        except concurrent.futures.TimeoutError:
            if stop_flags.reason(redis_url, sid) is not None:
                # Cancelling the call closes its connection; the agent sees the client go away.
                future.cancel()
                return _summary(row, "cancelled")
    result, failures, word = sort_outcome(outcome)
    try:
        report = lander(redis_url).land(req.run, result, failures)
    except ShardFencedError as exc:
        log.warning("%s", exc)
        return _summary(row, "fenced")
    if word == "failed" and not req.policy.route_failures_to_sidecar:
        final = failures[-1]
        message = (
            f"rollout {F.rollout_id(row)} failed: {final.get(F.FAILURE_CLASS)}: "
            f"{final.get(F.FAILURE_MESSAGE)}"
        )
        client(redis_url).set(keys.shard_run_failed(sid), message, nx=True)
    if report.duplicate:
        word = "duplicate"
    return _summary(row, word, requests=outcome.requests_sent)
