"""Health-check contracts: check ids, limits, report names, and the payloads of the recheck jobs.

The ids are NeMo Gym 0.7.0's fourteen (in its registry order), then the three that read the
record's own `response`, then the run-level check of the run accounting (docs/reference/health-checks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import Field, field_validator
from typing_extensions import TypedDict

from schemas.base import FrozenModel, StrictModel
from schemas.coverage import RunCoverage
from schemas.records import Generation, RateLimitWaits
from schemas.run_facts import ConfigFacts
from schemas.usage import TokenUsage

QUALITY_SUMMARY = "quality_summary.json"
ROLLOUT_VERDICTS = "rollout_verdicts.jsonl"
MERGED_SHARDS_SUFFIX = "_merged_shards.json"

HEALTH_SCAN_TASK = "rollouts.health_scan"
"""Task name of one recheck job over a byte range of one file."""
HEALTH_COMBINE_TASK = "rollouts.health_combine"
"""Task name of the chord callback that combines the recheck jobs into the reports."""

NEMO_CHECKS: tuple[str, ...] = (
    "check_execution_error",
    "record_unreadable",
    "rollout_duplicate_identity",
    "rollout_missing_agent_turns",
    "rollout_ended_on_failed_model_call",
    "agent_turn_hollow",
    "model_call_zero_completion_tokens",
    "model_call_missing_token_counts",
    "trajectory_capture_mismatch",
    "model_call_failed",
    "rollout_token_count_mismatch",
    "model_call_runaway_generation",
    "task_consistently_unhealthy",
    "task_no_successful_model_calls",
)
RESPONSE_CHECKS: tuple[str, ...] = (
    "rollout_response_truncated",
    "rollout_response_empty",
    "rollout_context_window_exceeded",
)
RUN_CHECK: Final = "run_excessive_failures"
ALL_CHECKS: tuple[str, ...] = (*NEMO_CHECKS, *RESPONSE_CHECKS, RUN_CHECK)
TASK_CHECKS: tuple[str, ...] = ("task_consistently_unhealthy", "task_no_successful_model_calls")
ROLLOUT_CHECKS: tuple[str, ...] = tuple(
    c for c in ALL_CHECKS if c not in TASK_CHECKS and c != RUN_CHECK
)


Verdict = Literal["healthy", "unhealthy", "unobserved"]
VERDICTS: tuple[Verdict, ...] = ("healthy", "unhealthy", "unobserved")
ISSUES_FIELD = "issues:"
"""Prefix of the live health hash's per-check fields (`infra/keys.py`: `shard_health`)."""


class VerdictJson(TypedDict):
    """A landed record's live verdict as the rollout task's result shows it (Flower)."""

    verdict: Verdict
    findings: dict[str, int]
    """How many findings each check made."""


@dataclass(frozen=True, slots=True)
class RolloutVerdict:
    """One landed record's verdict and the checks of its findings, as the finish step judges it
    (without the duplicate check, which needs every record): what live health counts."""

    verdict: Verdict
    findings: tuple[str, ...] = ()
    """The check id of each finding (a check may find several things in one record)."""

    def counter_fields(self) -> list[str]:
        """The live health hash's fields this verdict adds one to."""
        return [self.verdict, *(ISSUES_FIELD + check for check in self.findings)]

    def as_json(self) -> VerdictJson:
        """What the rollout task's result shows (Flower)."""
        checks: dict[str, int] = {}
        for check in self.findings:
            checks[check] = checks.get(check, 0) + 1
        return {"verdict": self.verdict, "findings": checks}


class LiveHealth(StrictModel):
    """A shard's verdict counts over the records landed so far, from its Redis counters."""

    verdicts: dict[str, int]
    """Landed records by verdict: healthy, unhealthy, unobserved."""
    issues: dict[str, int]
    """Findings by check id (those with any)."""

    @classmethod
    def of(cls, fields: dict[str, int]) -> LiveHealth:
        return cls(
            verdicts={v: fields.get(v, 0) for v in VERDICTS},
            issues={
                k[len(ISSUES_FIELD) :]: n
                for k, n in sorted(fields.items())
                if k.startswith(ISSUES_FIELD) and n
            },
        )


class CheckScope(StrEnum):
    """What one evaluation of a check judges."""

    ROLLOUT = "rollout"
    TASK = "task"
    RUN = "run"


class CheckSubject(StrEnum):
    """What a check's findings point at (their locator)."""

    CHECK_EXECUTION = "check_execution"
    RECORD = "record"
    ROLLOUT = "rollout"
    AGENT_TURN = "agent_turn"
    MODEL_CALL = "model_call"
    TRAJECTORY_CAPTURE = "trajectory_capture"
    TASK = "task"
    STEP = "step"
    GROUP = "group"


class CheckInput(StrEnum):
    """Persisted or derived evidence a check reads; without it the check is unobserved."""

    RECORD = "record"
    """The rollout record itself (a JSON object)."""
    TRAJECTORY = "trajectory"
    """An observed `ng_trajectory`."""
    AGENT_TURNS = "agent_turns"
    """The trajectory's turns, observed."""
    BOUND_CALLS = "bound_calls"
    """Calls bound to turns by their references (turn bindings)."""
    OWNED_MODEL_CALLS = "owned_model_calls"
    """Calls bound to turns or invocations (owned bindings)."""
    OBSERVED_MODEL_CALLS = "observed_model_calls"
    """Every captured call of the trajectory, observed."""
    SELECTED_CALLS = "selected_calls"
    """The model outputs judged for faults: the verified successful raw model responses bound to
    agent turns of a complete call scope; a record with no captured call has one, its own final
    `response` (so the fault checks work without capture)."""
    STEP_USAGE = "step_usage"
    """The record's `step_usage` (agents that solve a task in sub-steps)."""
    REPEAT_VERDICTS = "repeat_verdicts"
    """The verdicts of a task's repeats."""
    REPEAT_DIGESTS = "repeat_digests"
    """The call statistics of a task's repeats."""
    RUN_ACCOUNTING = "run_accounting"
    """Owed, landed and failed rollouts of the run, per group."""


CALL_BINDING_VIEWS = frozenset(
    {CheckInput.BOUND_CALLS, CheckInput.OWNED_MODEL_CALLS, CheckInput.SELECTED_CALLS}
)
"""The views that join references to captured calls; a check reads at most one of them."""


class CheckSpec(FrozenModel):
    """A stable, self-describing health-check contract: its id, scope, subject and reads."""

    id: str
    """The check id, as it appears in the summary and the verdict lines."""
    scope: CheckScope
    """Per rollout, per task, or once per run."""
    subject: CheckSubject
    """What its findings point at."""
    reads: frozenset[CheckInput]
    """The evidence it reads: missing any of it leaves the check unobserved."""

    @field_validator("reads")
    @classmethod
    def _one_call_binding_view(cls, reads: frozenset[CheckInput]) -> frozenset[CheckInput]:
        if len(reads & CALL_BINDING_VIEWS) > 1:
            raise ValueError(
                "a health check cannot read both turn-bound and invocation-owned call bindings"
            )
        if not reads:
            raise ValueError("a health check reads some evidence")
        return reads


STOPPED_BY_SIGTERM = "stopped by SIGTERM"
"""The stop reason `rollouts run` records for its shard when it receives SIGTERM."""

SummaryState = Literal["complete", "provisional", "disabled"]
LIMIT_NAMES: tuple[str, ...] = ("max_failed_rollouts", "max_failed_fraction")


class Limits(StrictModel):
    """The limits `run_excessive_failures` judges by; None is no limit."""

    max_failed_rollouts: int | None = Field(default=None, ge=0)
    """A group fails once this many of its rollouts failed."""
    max_failed_fraction: float | None = Field(default=None, ge=0, le=1)
    """A group fails once this fraction of its owed rollouts failed."""

    def any(self) -> bool:
        return self.max_failed_rollouts is not None or self.max_failed_fraction is not None


class Source(StrictModel):
    """One rollouts file a check reads, with the sidecars found beside it."""

    label: str
    """Its path relative to the folder the reports are written in (`run.sources`)."""
    dir: str
    """URL of the folder that holds it."""
    name: str
    """Its file name in that folder."""
    failures: str | None = None
    """File name of its failures sidecar, when one exists."""
    materialized: str | None = None
    """File name of its materialized inputs (the inventory of owed rollouts), when one exists."""
    drained: int | None = None
    """Rollouts drained (never started), from its status record; None when unknown."""
    rate_limit_waits: dict[str, RateLimitWaits] | None = None
    """Per agent, the 429/503 replies waited out, from its status record; None when unknown."""
    tokens: TokenUsage | None = None
    """Tokens (and cost) of its landed rollouts, from its status record; None when unknown."""
    config_facts: ConfigFacts | None = None
    """What its run's config stated as written, from its manifest; None without one."""
    capture_dir: str | None = None
    """The model-call capture dir its failed rollouts' calls are read from (the timeouts
    section); None when capture was off or its dir is not known."""
    generations: list[Generation] = Field(default_factory=list)
    """Its manifest's dispatch generations: which one reserved each rollout last, so that the
    accounting selects a rollout's standing failure by the coverage's rule; empty without one."""
    coverage_file: str | None = None
    """File name of its shard's coverage record (`rollouts-S_coverage.json`), when one exists."""
    coverage: RunCoverage | None = None
    """What that record says, when it could be read."""


FileKind = Literal["results", "failures", "materialized"]


class ScanJob(StrictModel):
    """One recheck job: the lines that start inside [start, end) of one file of one source."""

    scratch: str
    """URL of the folder the job writes its sorted runs into."""
    job: int
    """The job's number within the plan (names its runs)."""
    source: int
    """Index of the source in the plan."""
    kind: FileKind
    """Which of the source's files it reads."""
    dir: str
    """URL of the file's folder."""
    name: str
    """The file's name."""
    label: str
    """The source's label (for locators)."""
    start: int
    """First byte of the range."""
    end: int | None
    """End of the range (exclusive); None reads to the end."""
    ignored: list[str] = Field(default_factory=list)
    """Check ids to skip."""


class ScanResult(StrictModel):
    """What one job wrote and counted."""

    sha256: str | None = None
    """SHA-256 of the whole file, when the job read all of it (None for a byte range)."""
    size: int | None = None
    """The file's size in bytes, when the job read all of it."""

    job: int
    """The job's number."""
    runs: list[str] = Field(default_factory=list)
    """Names of its sorted runs in the scratch folder."""
    late: str | None = None
    """Name of its run of records whose identity needs the global line numbering."""
    lines: int = 0
    """Lines whose start lies in the range, blank ones included."""
    nonblank: int = 0
    """Non-blank lines among them."""
    bytes: int = 0
    """Bytes of those lines."""


class HealthPlan(StrictModel):
    """Everything the combine step needs besides the jobs' results."""

    report_dir: str
    """URL of the folder the reports are written in."""
    scratch: str
    """URL of the scratch folder (removed when done)."""
    sources: list[Source]
    """The rollouts files checked, in order."""
    jobs: list[ScanJob]
    """The jobs, in file order."""
    ignored: list[str] = Field(default_factory=list)
    """Check ids to skip."""
    limits: Limits = Field(default_factory=Limits)
    """The limits in force."""
    limit_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Limits set explicitly for this check: name -> {"persisted": old, "value": new}."""
