"""`RolloutFailureRecord`: a rollout that produced no `/run` result, as `run_outcomes` yields it.

The shape is NeMo Gym's `RolloutFailure` (schema_version, episode_id, run_id, source, delivery,
failure, http_status, exception_type) plus three fields of ours read from the failure row:
`failure_class`, `response_body` and `dispatch_drained`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas import fields as F

Delivery = Literal["not_sent", "possibly_delivered", "delivered"]
FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
REASON_LIMIT = 2000

# Failure kinds of a request that never reached the agent.
_NOT_SENT_KINDS = frozenset({"transport_unreachable", "transport_local_resource", "cancelled"})


class EpisodeId(BaseModel):
    """Which rollout, and which attempt of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str
    """The rollout's id without the attempt suffix: `_ng_rollout_id`, else `<task>-<rollout>`."""
    attempt: int = Field(default=0, ge=0)
    """`_ng_attempt_index` of the failed attempt."""


class FailureDetail(BaseModel):
    """Why the rollout failed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_reason: str = Field(max_length=REASON_LIMIT)
    """The failure message, at most 2,000 characters."""
    terminal: bool
    """True when retrying cannot help."""
    failure_kind: str | None = None
    """NeMo Gym's registered failure kind (`transport_timeout`, `agent_run_error`, ...)."""
    stage: FailureStage | None = None
    """Where it failed; `agent` for everything the collector sees of `/run`."""


class RolloutFailureRecord(BaseModel):
    """A rollout that produced no `/run` result: an HTTP, JSON or shape failure, or a drained row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
        cls, failure: dict[str, Any], run_id: str, fallback_id: str
    ) -> RolloutFailureRecord:
        """The record of a failure row or drained row of run `run_id`; `fallback_id` names a row
        without identity."""
        explicit = failure.get(F.ROLLOUT_ID)
        if explicit is not None:
            rollout_id = str(explicit)
        elif F.TASK_INDEX in failure and F.ROLLOUT_INDEX in failure:
            rollout_id = f"{failure[F.TASK_INDEX]}-{failure[F.ROLLOUT_INDEX]}"
        else:
            rollout_id = fallback_id
        attempt = failure.get(F.ATTEMPT_INDEX)
        drained = bool(failure.get(F.DISPATCH_DRAINED))
        status = failure.get(F.FAILURE_HTTP_STATUS)
        kind = failure.get(F.FAILURE_KIND) or ("cancelled" if drained else None)
        message = failure.get(F.FAILURE_MESSAGE) or failure.get("error_message") or "failed"
        if drained or kind in _NOT_SENT_KINDS:
            delivery: Delivery = "not_sent"
        elif isinstance(status, int):
            delivery = "delivered"
        else:
            delivery = "possibly_delivered"
        return cls(
            episode_id=EpisodeId(
                rollout_id=rollout_id,
                attempt=attempt if isinstance(attempt, int) and attempt > 0 else 0,
            ),
            run_id=run_id,
            delivery=delivery,
            failure=FailureDetail(
                failure_reason=str(message)[:REASON_LIMIT],
                terminal=bool(failure.get(F.FAILURE_TERMINAL)),
                failure_kind=kind,
                stage="admission" if drained else "agent",
            ),
            http_status=status if isinstance(status, int) and 100 <= status <= 599 else None,
            exception_type=(str(failure[F.FAILURE_TYPE])[:REASON_LIMIT]
                            if failure.get(F.FAILURE_TYPE) else None),
            failure_class=str(failure.get(F.FAILURE_CLASS) or "unknown"),
            response_body=failure.get(F.FAILURE_RESPONSE_BODY),
            dispatch_drained=drained,
        )  # fmt: skip
