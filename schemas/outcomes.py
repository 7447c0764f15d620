"""How a rollout ended: the one vocabulary (`Ended`), the engine's `RolloutOutcome`, and the
`RolloutFailureRecord` that `run_outcomes` yields for a rollout that produced no `/run` result.

`Ended` is the word every layer uses for the end of a rollout: the engine's outcome, the chord
task's summary, the Python API's reply, the admission ticket (`schemas.outcomes.Admit`), and the
generation counters in Redis (`drained`, `stopped`, `duplicate`, `cancelled`).

The record's shape is NeMo Gym's `RolloutFailure` (schema_version, episode_id, run_id, source, delivery,
failure, http_status, exception_type) plus three fields of ours read from the failure row:
`failure_class`, `response_body` and `dispatch_drained`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal, Required, cast

from pydantic import Field, JsonValue, SkipValidation, model_validator
from typing_extensions import TypedDict

from schemas import fields as F
from schemas.base import FrozenModel
from schemas.health import VerdictJson


class Ended(StrEnum):
    """How one delivery of a rollout ended."""

    LANDED = "landed"
    """The `/run` result is final: landed in the shard (or returned, for an unrecorded API call)."""
    AGENT_FAILURE = "agent_failure"
    """The agent answered with a failure row of its own (`_ng_failure_class`); it went to the sidecar."""
    NOT_PERSISTED = "not_persisted"
    """The agent answered with `_ng_no_persist`: nothing landed, a resume runs it again."""
    FAILED = "failed"
    """`/run` failed after its retries, or its record could not be stored (`result_not_stored`):
    the final failure row went to the sidecar."""
    WORKER_LOST = "worker_lost"
    """Workers died running it more often than the attempt limit: a `worker_lost` failure row."""
    DUPLICATE = "duplicate"
    """It had landed already (a redelivery): nothing was called or written."""
    FENCED = "fenced"
    """Another writer opened the shard since this task's generation: nothing was written."""
    DRAINED = "drained"
    """Not started: the dispatch budget ran out (a drained row, not persisted)."""
    STOPPED = "stopped"
    """Not started: the run was failed or cancelled (a drained row, not persisted)."""
    CANCELLED = "cancelled"
    """In flight when the run was failed or cancelled: the call was cut, nothing written."""
    ERROR = "error"
    """The worker could not finish it (Redis or storage unavailable); a resume runs it."""
    REDELIVERED = "redelivered"
    """A copy of a delivery (the broker redelivered it): another attempt holds the rollout's
    fresh lease, or the rollout settled already. Acknowledged without side effects, no death."""
    TAKEN_OVER = "taken_over"
    """This attempt's holder went silent and another attempt took its lease over: whatever this
    one did was refused by the lander, and it counts nothing."""


NOT_STARTED = frozenset({Ended.DRAINED, Ended.STOPPED})
"""Ends whose outcome carries a drained row."""
RESULT_ENDS = frozenset({Ended.LANDED, Ended.AGENT_FAILURE, Ended.NOT_PERSISTED})
"""Ends whose outcome carries the agent's `/run` result."""
FAILURE_ENDS = frozenset({Ended.FAILED, Ended.WORKER_LOST})
"""Ends whose outcome carries the final failure row the collector wrote."""
VOID_ENDS = frozenset({Ended.REDELIVERED, Ended.TAKEN_OVER})
"""Ends of a delivery that is not the rollout's: acknowledged, no chord part, no counts."""


def run_failure_message(rollout: object, final: dict[str, Any]) -> str:
    """The run's error for a rollout whose final failure row is `final` (failures not routed)."""
    return f"rollout {rollout} failed: {final.get(F.FAILURE_CLASS)}: {final.get(F.FAILURE_MESSAGE)}"


Admit = Literal["run", "wait", "duplicate", "fenced", "drained", "stopped", "worker_lost"]
"""An admission ticket's verdict: `run`; `wait` (the caps are full: try again); or the end of a
rollout that must not start."""


class ChordSummary(TypedDict, total=False):
    """What a rollout task returns (Flower shows it): the rollout, how it ended, and what tells
    the end apart."""

    rollout: Required[str | None]
    outcome: Required[str]
    row: dict[str, Any] | None
    """The drained row (NOT_STARTED)."""
    reason: str | None
    """Why it was cancelled."""
    error: str | None
    """Why the worker could not finish it."""
    requests: int
    """`/run` requests sent, when the agent was called."""
    health: VerdictJson
    """The landed result's live verdict."""


class RolloutOutcome(FrozenModel):
    """What the rollout engine returns for one delivery of a rollout."""

    rollout: str | None = None
    """The rollout's id (`_ng_rollout_id`, else `<task>-<rollout>`); None for an API row
    without identity. Every field has a default, so that no encoding of an outcome (a reply
    leaves its None fields out) parses differently from the outcome it encodes."""
    ended: Ended
    """How it ended."""
    # Not validated again: the engine builds it from a reply it already parsed and checked, and
    # a deep copy of every landed row would cost each rollout more than the rest of this model.
    record: SkipValidation[dict[str, Any] | None] = None
    """The `/run` result (RESULT_ENDS), the final failure row (FAILURE_ENDS) or the drained row
    (NOT_STARTED); None otherwise."""
    detail: str | None = None
    """Why, in words: the stop reason, the fencing writer, the error."""
    requests: int = 0
    """`/run` requests sent for this delivery, replays included."""
    run_ms: float | None = None
    """Duration of the `/run` call(s), retries included; None when nothing was called."""
    after_ms: float = 0.0
    """From the end of the call until the outcome was final (sorting and landing)."""
    health: VerdictJson | None = None
    """The landed result's live verdict and its findings by check (`RolloutVerdict.as_json`);
    None when it was not judged or did not land."""

    def chord_summary(self) -> ChordSummary:
        """The small JSON dict the chord task returns."""
        summary: ChordSummary = {"rollout": self.rollout, "outcome": self.ended.value}
        if self.ended in NOT_STARTED:
            summary["row"] = self.record
        elif self.ended is Ended.CANCELLED:
            summary["reason"] = self.detail
        elif self.ended is Ended.ERROR:
            summary["error"] = self.detail
        if self.run_ms is not None:
            summary["requests"] = self.requests
        if self.health is not None:
            summary["health"] = self.health
        return summary


Delivery = Literal["not_sent", "possibly_delivered", "delivered"]
FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
REASON_LIMIT = 2000
_STAGES = frozenset({"admission", "seed", "agent", "verification", "cleanup"})

# Failure kinds of a request that never reached the agent.
_NOT_SENT_KINDS = frozenset({"transport_unreachable", "transport_local_resource", "cancelled"})


def spends_attempt(row: Mapping[str, Any]) -> bool:
    """Whether a failure row spends one of its rollout's attempts (`max_attempts`): only when the
    request was delivered or possibly delivered, as its `_ng_failure_record` says (for a row
    without one, as the record made from it would say). A request that was never sent (the agent
    unreachable, a local resource exhausted, the call cancelled before sending) spends none."""
    record = row.get(F.FAILURE_RECORD)
    delivery = record.get("delivery") if isinstance(record, Mapping) else None
    if delivery in ("not_sent", "possibly_delivered", "delivered"):
        return bool(delivery != "not_sent")
    kind = row.get(F.FAILURE_KIND)
    return not (row.get(F.DISPATCH_DRAINED) or kind in _NOT_SENT_KINDS)


class EpisodeId(FrozenModel):
    """Which rollout, and which attempt of it."""

    rollout_id: str
    """The rollout's id without the attempt suffix: `_ng_rollout_id`, else `<task>-<rollout>`."""
    attempt: int = Field(default=0, ge=0)
    """`_ng_attempt_index` of the failed attempt."""


class FailureDetail(FrozenModel):
    """Why the rollout failed."""

    failure_reason: str = Field(max_length=REASON_LIMIT)
    """The failure message, at most 2,000 characters."""
    terminal: bool
    """True when retrying cannot help."""
    failure_kind: str | None = None
    """NeMo Gym's registered failure kind (`transport_timeout`, `agent_run_error`, ...)."""
    stage: FailureStage | None = None
    """Where it failed; `agent` for everything the collector sees of `/run`."""


class RolloutFailureRecord(FrozenModel):
    """A rollout that produced no `/run` result: an HTTP, JSON or shape failure, or a drained row."""

    schema_version: Literal[1] = 1
    """Layout version of this record."""
    episode_id: EpisodeId
    """The rollout and attempt."""
    run_id: str = Field(min_length=1)
    """The run the rollout belongs to."""
    source: Literal["environment", "collector"] = "collector"
    """Who reported it; the collector for every failure of the `/run` call."""
    delivery: Delivery
    """Whether the agent may have seen the request: not_sent, possibly_delivered, delivered."""
    failure: FailureDetail
    """Why it failed."""
    http_status: int | None = Field(default=None, ge=100, le=599)
    """The HTTP status of the reply, when there was one."""
    exception_type: str | None = Field(default=None, max_length=REASON_LIMIT)
    """The exception or cause name (`HTTPStatusError`, `JSONDecodeError`, `ReadTimeout`, ...)."""
    failure_class: str
    """The failure row's `_ng_failure_class` (ours)."""
    response_body: str | None = None
    """At most 2,000 characters of the reply body (ours)."""
    dispatch_drained: bool = False
    """The rollout never started: the dispatch budget ran out or the run was stopped (ours)."""

    @model_validator(mode="after")
    def _environment_is_delivered(self) -> RolloutFailureRecord:
        if self.source == "environment" and self.delivery != "delivered":
            raise ValueError("an environment-reported failure requires delivery='delivered'")
        return self

    @classmethod
    def from_failure_row(
        cls,
        failure: dict[str, Any],
        run_id: str,
        fallback_id: str,
        source: Literal["environment", "collector"] = "collector",
    ) -> RolloutFailureRecord:
        """The record of a failure row or drained row of run `run_id`; `fallback_id` names a row
        without identity. `source`: who observed it; an environment's failure (an agent's own
        failure row, a reply of HTTP 200) reached its observer, so it was delivered."""
        planned = F.base_rollout_id(failure)
        rollout_id = fallback_id if planned is None else planned
        attempt = failure.get(F.ATTEMPT_INDEX)
        drained = bool(failure.get(F.DISPATCH_DRAINED))
        status = failure.get(F.FAILURE_HTTP_STATUS)
        kind = failure.get(F.FAILURE_KIND) or ("cancelled" if drained else None)
        message = failure.get(F.FAILURE_MESSAGE) or failure.get("error_message") or "failed"
        stage = failure.get(F.FAILURE_STAGE)
        if source == "environment":
            delivery: Delivery = "delivered"
        elif drained or kind in _NOT_SENT_KINDS:
            delivery = "not_sent"
        elif isinstance(status, int):
            delivery = "delivered"
        else:
            delivery = "possibly_delivered"
        stage_: FailureStage = "admission" if drained else "agent"
        if isinstance(stage, str) and stage in _STAGES:
            stage_ = cast(FailureStage, stage)
        return cls(
            episode_id=EpisodeId(
                rollout_id=rollout_id,
                attempt=attempt if isinstance(attempt, int) and attempt > 0 else 0,
            ),
            run_id=run_id,
            source=source,
            delivery=delivery,
            failure=FailureDetail(
                failure_reason=str(message)[:REASON_LIMIT],
                terminal=bool(failure.get(F.FAILURE_TERMINAL)),
                failure_kind=str(kind) if kind is not None else None,
                stage=stage_,
            ),
            http_status=status if isinstance(status, int) and 100 <= status <= 599 else None,
            exception_type=(str(failure[F.FAILURE_TYPE])[:REASON_LIMIT]
                            if failure.get(F.FAILURE_TYPE) else None),
            failure_class=str(failure.get(F.FAILURE_CLASS) or "unknown"),
            response_body=failure.get(F.FAILURE_RESPONSE_BODY),
            dispatch_drained=drained,
        )  # fmt: skip

    def canonical(self) -> dict[str, JsonValue]:
        """NeMo Gym's `RolloutFailure` fields alone, as a failure row's `_ng_failure_record`."""
        return self.model_dump(mode="json", exclude=_OURS)


_OURS = {"failure_class", "response_body", "dispatch_drained"}
