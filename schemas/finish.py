"""What the finish step of a shard returns: its final state, counts and health brief.

The finish task (`rollouts.finish`) returns `FinishResult.model_dump(mode="json")`; whoever reads
it back (the waiting producer, the Python API) validates it into the model.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FinishResult(BaseModel):
    """The finish step's result: the shard's final state and what the producer prints of it."""

    model_config = ConfigDict(frozen=True)

    state: str
    """`completed`, `failed` or `cancelled`; `superseded` when a later dispatch owns the shard."""
    error: str | None = None
    """The manifest's error: the run's first error, the cancel, an aggregation error, a rejection."""
    run_error: str | None = None
    """The first error of a run that failed (`route_failures_to_sidecar` off), or the stop."""
    cancelled: str | None = None
    """`cancel` or `drain` when `rollouts cancel` stopped the run."""
    rejection: str | None = None
    """The `require_complete` message when fewer results landed than were planned."""
    landed: int | None = None
    """Distinct rollouts in `rollouts-S.jsonl`."""
    planned: int | None = None
    """Planned rollouts."""
    failed: dict[str, int] = Field(default_factory=dict)
    """Rollouts without a result, by the class of their latest failure."""
    drained: int = 0
    """Rollouts of the generation not started because the dispatch budget ran out."""
    stopped: int = 0
    """Rollouts of the generation not started because the run failed or was cancelled."""
    aggregation_error: str | None = None
    """The first `/aggregate_metrics` error, if any."""
    health: dict[str, Any] | None = None
    """The health check's brief (state, verdict, reasons, verdict counts, path) or its error."""
