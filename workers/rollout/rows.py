"""The records a rollout's end is written as: sorting a call's outcome, drained and lost rows."""

from __future__ import annotations

from typing import Any

from pydantic import JsonValue

from schemas import fields as F
from schemas.messages import CollectRequest
from schemas.outcomes import Ended
from schemas.records import FailureRow
from workers.rollout.admission import Ticket
from workers.rollout.agent_call import CallOutcome, failure_row


def sort_outcome(outcome: CallOutcome) -> tuple[dict[str, Any] | None, list[dict[str, Any]], Ended]:
    """(result for rollouts-S.jsonl, rows for the sidecar, how the rollout ended)."""
    failures = list(outcome.failures)
    result = outcome.result
    if result is not None:
        if result.get(F.NO_PERSIST):
            return None, failures, Ended.NOT_PERSISTED
        if result.get(F.FAILURE_CLASS) is not None:
            failures.append(result)
            return None, failures, Ended.AGENT_FAILURE
        return result, failures, Ended.LANDED
    assert outcome.final_failure is not None
    failures.append(outcome.final_failure)
    return None, failures, Ended.FAILED


def stamp_timing(records: list[dict[str, Any]], started_at: float, run_ms: float) -> None:
    """Stamp the records a delivery lands with when its `/run` call started and how long it
    took: what `rollouts report` draws latency and throughput over time from."""
    for record in records:
        record[F.STARTED_AT] = round(started_at, 3)
        record[F.RUN_MS] = round(run_ms, 3)


def stamp_execution(records: list[dict[str, Any]], generation: int, attempt: int) -> None:
    """Stamp the records a delivery lands with the execution that wrote them (`_ng_execution`)."""
    for record in records:
        record[F.EXECUTION] = {"generation": generation, "attempt": attempt}


def drained_row(row: dict[str, Any], message: str) -> dict[str, JsonValue]:
    """What a rollout that never started resolves to (docs/reference/failures.md#drained-rows); it lands nowhere."""
    return {
        **{k: row[k] for k in F.IDENTITY_FIELDS if k in row},
        F.FAILURE_CLASS: "cancelled",
        F.NO_PERSIST: True,
        F.DISPATCH_DRAINED: True,
        "error_message": message,
    }


def not_started_message(ticket: Ticket, margin_s: float | None) -> str:
    """Why a drained or stopped rollout was not dispatched; `margin_s` is the run's drain margin."""
    if ticket.verdict == "stopped":
        if ticket.detail.startswith("failed: "):
            return f"not dispatched: the run {ticket.detail}"
        return "not dispatched: the run is " + (
            "draining" if ticket.detail == "drain" else "cancelled"
        )
    remaining = float(ticket.detail)
    if remaining <= 0 or margin_s is None:
        return "not dispatched: dispatch budget exhausted"
    return (
        f"not dispatched: {remaining:.0f}s left in dispatch budget, "
        f"below the {margin_s:.0f}s drain margin"
    )


def worker_lost_row(req: CollectRequest, deaths: int) -> dict[str, JsonValue]:
    """The failure row of a rollout whose workers died on it `deaths` times."""
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
