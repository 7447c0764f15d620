"""NeMo Gym 0.7.0's `TrajectoryRecord` (`ng_trajectory`), as strict as its own models.

Every model forbids extra keys (NeMo Gym's `ObservationModel`), except `ModelServerRef`, which
ignores them, as NeMo Gym's does. Health re-validates a record's `ng_trajectory` with
`TrajectoryRecord`; what fails here NeMo Gym's health check finds `record_unreadable` too. The
capture merge (`workers/capture`) builds its trajectories through the same models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, model_validator

from schemas.base import StrictModel

ObservationStatus = Literal["completed", "failed", "incomplete", "unknown"]
ToolStatus = Literal["completed", "failed", "timeout", "cancelled", "incomplete", "unknown"]


class _Observation(StrictModel):
    """NeMo Gym's `ObservationModel`: unknown keys are refused."""

    model_config = ConfigDict(validate_assignment=True)


class ModelServerRef(BaseModel):
    """A model server by config name; extra keys are ignored, as in NeMo Gym."""

    type: Literal["responses_api_models"]
    """Always `responses_api_models`."""
    name: str
    """The model server's config name."""


class ModelCallRef(_Observation):
    """A reference to one captured call: by id, or by model server and response id."""

    model_call_id: str | None = None
    """The capture's `model_call_id`."""
    model_ref: ModelServerRef | None = None
    """The model server, with `response_id`."""
    response_id: str | None = None
    """The response's id, with `model_ref`."""

    @model_validator(mode="after")
    def _names_a_call(self) -> ModelCallRef:
        if not self.model_call_id and not (self.model_ref is not None and self.response_id):
            raise ValueError("model_call_id or both model_ref and response_id are required")
        return self


class TrajectoryTokenStats(_Observation):
    """Token counts of one call (capture names mapped to the trajectory's)."""

    prompt_tokens: NonNegativeInt | None = None
    """Prompt size (capture `tokens_in`)."""
    completion_tokens: NonNegativeInt | None = None
    """Generated tokens (capture `tokens_out`)."""
    reasoning_tokens: NonNegativeInt | None = None
    """Reasoning tokens among them; None is unknown."""
    total_tokens: NonNegativeInt | None = None
    """Prompt plus completion."""
    cached_tokens: NonNegativeInt | None = None
    """Prompt tokens served from a cache."""


class TrajectoryResponseMetadata(_Observation):
    """What the capture knew of one call's response."""

    response_id: str | None = None
    """The response's id."""
    model_ref: ModelServerRef | None = None
    """The model server that served it."""
    model: str | None = None
    """The model the response names."""
    dialect: str | None = None
    """`responses`, `chat` or `messages`."""
    status_code: int | None = None
    """HTTP status of the response."""
    response_status: str | None = None
    """The response's own `status`."""
    finish_reason: str | None = None
    """Why generation stopped."""
    upstream_attempted: bool | None = None
    """Whether an upstream call was made."""
    response_source: Literal["upstream", "local"] | None = None
    """Who produced the response."""
    upstream_status_code: int | None = None
    """The upstream's HTTP status."""
    local_response_reason: str | None = None
    """Why a local response was synthesised."""
    error_category: str | None = None
    """The capture's error category (NeMo Gym 0.7.0's)."""
    latency_ttft_ms: NonNegativeFloat | None = None
    """Time to the first body chunk."""


class TrajectoryModelCall(_Observation):
    """One model call of the trajectory."""

    model_call_id: str | None = None
    """The capture's id of the call."""
    started_at: float | None = None
    """Unix seconds when it started."""
    completed_at: float | None = None
    """Unix seconds when it ended."""
    duration_ms: NonNegativeFloat | None = None
    """Its latency."""
    request: Any = None
    """The request body (an object, else the raw text)."""
    response: Any = None
    """The response body (an object, else the raw text)."""
    response_metadata: TrajectoryResponseMetadata = Field(
        default_factory=TrajectoryResponseMetadata
    )
    """Status, ids and finish reason."""
    token_stats: TrajectoryTokenStats = Field(default_factory=TrajectoryTokenStats)
    """Its token counts."""


class TrajectoryTurn(_Observation):
    """One agent turn."""

    invocation_id: str
    """The agent invocation it belongs to."""
    task_id: str
    """Must equal the trajectory's."""
    rollout_id: str
    """Must equal the trajectory's."""
    turn_no: int = Field(ge=1)
    """1, 2, ... within its invocation."""
    timestamp: float
    """When it started (Unix seconds)."""
    step_count: NonNegativeInt
    """Tool calls before it in its invocation."""
    question: Any = None
    """What the model was asked."""
    answer: Any = None
    """What it answered."""
    reasoning_content: Any = None
    """Its reasoning."""
    resolved: bool | None = None
    """The task's verdict, on the last turn."""
    model_calls: list[ModelCallRef] = Field(default_factory=list)
    """The calls this turn made."""


class AgentInvocation(_Observation):
    """One run of an agent within the rollout."""

    kind: Literal["agent_invocation"] = "agent_invocation"
    """The observation kind."""
    invocation_id: str
    """Unique within the trajectory."""
    parent_invocation_id: str | None = None
    """The invocation that spawned it."""
    spawned_by_tool_call_id: str | None = None
    """The tool call that spawned it."""
    status: ObservationStatus = "unknown"
    """How it ended."""
    duration_ms: NonNegativeFloat | None = None
    """How long it ran."""
    error_type: str | None = None
    """Its error, when it failed."""
    model_calls: list[ModelCallRef] = Field(default_factory=list)
    """The calls it owns."""
    conversation: list[dict[str, Any]] = Field(default_factory=list)
    """Responses-API input items."""


class TrajectoryToolCall(_Observation):
    """One tool call of an invocation."""

    kind: Literal["tool_call"] = "tool_call"
    """The observation kind."""
    invocation_id: str
    """The invocation that made it."""
    tool_call_id: str
    """Its id."""
    sandbox_id: str | None = None
    """The sandbox it ran in."""
    tool_name: str | None = None
    """The tool's name."""
    started_at: float | None = None
    """Unix seconds when it started."""
    completed_at: float | None = None
    """Unix seconds when it ended."""
    duration_ms: NonNegativeFloat | None = None
    """How long it ran."""
    timing_source: Literal["executor", "artifact", "harness"] | None = None
    """Who timed it."""
    status: ToolStatus = "unknown"
    """How it ended."""
    error_type: str | None = None
    """Its error, when it failed."""
    output: Any = None
    """What it returned."""

    @model_validator(mode="after")
    def _ordered(self) -> TrajectoryToolCall:
        if (
            self.started_at is not None
            and self.completed_at is not None
            and self.completed_at < self.started_at
        ):
            raise ValueError("completed_at must not precede started_at")
        return self


class ObservationGap(_Observation):
    """Evidence that is missing, and why."""

    code: str
    """The gap kind (NeMo Gym 0.7.0's)."""
    invocation_id: str | None = None
    """The invocation it concerns."""
    detail: str | None = None
    """More about it."""


class TrajectoryRecord(_Observation):
    """A rollout's trajectory: invocations, turns, model calls, tool calls and gaps."""

    schema_version: Literal["1.0"] = "1.0"
    """Only 1.0 exists."""
    task_id: str
    """The task's id."""
    rollout_id: str
    """The capture key (rollout id, `-a<n>` for attempts after the first)."""
    invocations: list[AgentInvocation] = Field(default_factory=list)
    """Agent invocations."""
    turns: list[TrajectoryTurn] = Field(default_factory=list)
    """Agent turns."""
    model_calls: list[TrajectoryModelCall] = Field(default_factory=list)
    """Model calls, producer's first, then captured ones."""
    tool_calls: list[TrajectoryToolCall] = Field(default_factory=list)
    """Tool calls."""
    gaps: list[ObservationGap] = Field(default_factory=list)
    """What could not be observed."""

    @model_validator(mode="after")
    def _consistent(self) -> TrajectoryRecord:
        ids = [i.invocation_id for i in self.invocations]
        if len(ids) != len(set(ids)):
            raise ValueError("invocation_id must be unique within a trajectory")
        calls = [c.model_call_id for c in self.model_calls if c.model_call_id]
        if len(calls) != len(set(calls)):
            raise ValueError("model_call_id must be unique within a trajectory")
        seen: set[tuple[str, int]] = set()
        for turn in self.turns:
            if turn.task_id != self.task_id or turn.rollout_id != self.rollout_id:
                raise ValueError("turn identity must match the trajectory")
            key = (turn.invocation_id, turn.turn_no)
            if key in seen:
                raise ValueError("turn number must be unique within an invocation")
            seen.add(key)
        return self
