"""What the finish step of a shard returns: its final state, counts, health brief and coverage.

The finish task (`rollouts.finish`) returns `FinishResult.model_dump(mode="json")`; whoever reads
it back (the waiting producer, the Python API) validates it into the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.coverage import RunCoverage


class Coverage(BaseModel):
    """How much of the planned rollouts the aggregate metrics cover (NeMo Gym's coverage lines)."""

    model_config = ConfigDict(frozen=True)

    expected: int
    """Planned rollouts: lines of the materialized inputs."""
    scored: int
    """Rollouts in the metrics: landed results, failures counted as zero and imputed zeros."""
    failures_counted_as_zero: int = 0
    """Rollouts whose latest failure is of a class in `count_failure_classes_as_zero`."""
    imputed: int = 0
    """Rollouts that left no row, scored as zero by `count_missing_rollouts_as_zero`."""
    dropped: dict[str, int] = Field(default_factory=dict)
    """Rollouts left out of the score by the class of their latest failure."""
    failures_path: str = ""
    """The failures sidecar the coverage lines point to."""

    @property
    def missing(self) -> int:
        return max(0, self.expected - self.scored)

    def lines(self) -> list[str]:
        """The coverage lines: none when the metrics cover every planned rollout and none is imputed."""
        out = []
        if self.missing:
            routed = ", ".join(f"{n} {cls}" for cls, n in sorted(self.dropped.items()))
            routed = f"{routed} routed this run; " if routed else ""
            out.append(
                f"Rollouts missing from the score: {self.missing} of {self.expected} "
                f"materialized ({routed}see {self.failures_path})"
            )
            out.append(f"Metrics cover: {self.scored} of {self.expected} rollouts")
        if self.imputed:
            out.append(
                f"Scored as zero because they left no row: {self.imputed} of {self.expected} rollouts"
            )
        return out


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
    """The `require_complete` message when fewer rollouts completed than were planned."""
    partial: bool = False
    """It saved a partial result that a resume can complete (exit 75): drained by its dispatch
    budget or `cancel --drain`, stopped by SIGTERM, or rejected with rollouts left to run, and
    this generation made progress."""
    progress: bool = True
    """This generation wrote outcomes (results or failure rows)."""
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
    health: Mapping[str, Any] | None = None
    """The health check's brief (state, verdict, reasons, verdict counts, path) or its error: a
    `schemas.quality_summary.HealthBrief` or `HealthError` when written, any mapping read back."""
    coverage: Coverage | None = None
    """The metrics' coverage of the planned rollouts; None when aggregation did not run."""
    run_coverage: RunCoverage | None = None
    """The exact account of the expected rollouts (`rollouts-S_coverage.json`)."""
    report: str | None = None
    """Where the run report (`report.html`) was written; None when it is off or failed."""
