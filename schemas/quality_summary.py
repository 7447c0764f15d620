"""The `run` object of `quality_summary.json` and the brief of it a finish step returns.

Typed dicts, not models: the summary is written by orjson straight from these values (key
order is the order the writer builds them in), and read back as plain JSON by the producer's
console lines and `--fail-on-unhealthy`.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, final

from schemas.coverage import WrittenBy
from schemas.health import SummaryState


class CheckCoverage(TypedDict):
    """How many records a check evaluated, found no evidence in, or skipped (null: not read)."""

    evaluated: int | None
    unobserved: int | None
    ignored: int | None


class Artifacts(TypedDict):
    """`run.artifacts`: records and captures read, and each check's coverage of them."""

    records: int | None
    captures: int | None
    coverage: dict[str, CheckCoverage]


class FailedCounts(TypedDict):
    """`accounting.failed`: failed rollouts, in all and by failure class."""

    total: int | None
    by_class: dict[str, int] | None


class RunCheck(TypedDict):
    """`accounting.run_excessive_failures`: the run-level check's coverage and findings."""

    coverage: str | None
    unobserved_reason: str | None
    findings: list[dict[str, Any]]


class AccountingSection(TypedDict):
    """`run.accounting`: owed, landed, scored, failed and missing rollouts (null: not counted)."""

    owed: int | None
    landed: int | None
    scored: int | None
    failed: FailedCounts
    missing: int | None
    omitted: NotRequired[int]
    drained: int | None
    rate_limit_waits: dict[str, dict[str, float]] | None
    tokens: dict[str, Any] | None
    duplicates: int | None
    not_owed: int | None
    unreadable: int | None
    run_excessive_failures: NotRequired[RunCheck]


class LimitsSection(TypedDict):
    """`run.limits`: the failure limits judged by, and the ones a recheck overrode."""

    max_failed_rollouts: int | None
    max_failed_fraction: float | None
    overrides: dict[str, dict[str, Any]]


class TimeoutGroup(TypedDict):
    """One (failure class, agent) of `run.timeouts`; the time split only when captures were read."""

    failure_class: str
    agent: str | None
    rollouts: int
    measured: NotRequired[int]
    """Rollouts whose time could be split (their captured calls and `/run` duration read)."""
    model_calls: NotRequired[int]
    model_call_s: NotRequired[float]
    """Seconds inside model calls, over the measured rollouts."""
    other_s: NotRequired[float]
    """Seconds of `/run` outside model calls (tools, the agent's own work)."""
    unmeasured: NotRequired[dict[str, int]]
    """Rollouts counted but not measured, by why (`workers.health.timeouts.UNMEASURED`)."""


class TimeoutsSection(TypedDict):
    """`run.timeouts`: the failed rollouts' time in model calls and elsewhere."""

    state: Literal["observed", "unobserved"]
    unobserved_reason: str | None
    groups: list[TimeoutGroup]


class GateSection(TypedDict):
    """`run.gate`: what a gate judges, bound to the digests of the inputs read."""

    healthy: bool | None
    unhealthy_rollouts: int | None
    failed_rollouts: int | None
    inputs: list[dict[str, Any]]


class CoverageFile(TypedDict):
    """One source's coverage record, as `run.coverage.files` points at it."""

    source: str
    path: str | None
    complete: bool | None
    written_by: WrittenBy | None
    updated_at: str | None


class CoverageSection(TypedDict):
    """`run.coverage`: whether the sources' coverage records say the run is complete, summed."""

    complete: bool | None
    expected: int | None
    successful: int | None
    failed: int | None
    intentionally_omitted: int | None
    unknown: int | None
    files: list[CoverageFile]


class SummaryRun(TypedDict):
    """The `run` object of `quality_summary.json`."""

    ignored_checks: list[str]
    artifacts: Artifacts
    verdicts: dict[str, int | None]
    issues: dict[str, int | None]
    stats: dict[str, Any] | None
    state: SummaryState
    healthy: bool | None
    reasons: list[str]
    accounting: AccountingSection
    limits: LimitsSection
    sources: list[str]
    timeouts: TimeoutsSection | None
    config: dict[str, Any] | None
    gate: GateSection | None
    coverage: CoverageSection | None


@final
class HealthBrief(TypedDict):
    """What a finish step returns of its health check: the part of the summary a caller prints."""

    state: SummaryState
    healthy: bool | None
    reasons: list[str]
    verdicts: dict[str, int | None]
    ignored_checks: list[str]
    timeouts: TimeoutsSection | None
    path: str
    blind_checks: list[str]


@final
class HealthError(TypedDict):
    """What a finish step returns of a health check that raised."""

    error: str
    path: str
