"""The exact account of a shard's expected rollouts: `rollouts-S_coverage.json` and its states.

Every expected rollout (a line of the materialized inputs) is in exactly one of NeMo Gym's nine
recovery states, decided from what is on storage alone (`workers/shard/coverage.py`):

| state | the rollout's standing outcome |
|---|---|
| `scored` | a result (with or without a reward), not masked |
| `masked` | a result with `mask_sample` set: completed, not measured |
| `model_final` | a failure settled as a scored zero (`count_failure_classes_as_zero`, `_ng_failure_counts_as_zero`) |
| `terminal` | a failure marked `_ng_failure_terminal`: the run cannot become complete through it |
| `judge_recoverable` | a judge's failure that kept the agent's answer: it can be judged again without a rollout |
| `exhausted` | a failure at its attempt limit; only `--extend-retries` gives it a new budget |
| `retryable` | a failure below its attempt limit |
| `omitted` | an intentional omission (`_ng_omitted`) |
| `missing` | no outcome of its newest reserved execution: never run, drained, stopped, killed |

The counts, in NeMo Gym's names, obey `successful = measured + masked + unscored` and
`expected = measured + masked + unscored + failed + intentionally_omitted + unknown`, where
`unknown` is the residual (a partial run never reads as complete).
"""

from __future__ import annotations

from typing import Literal, Required, TypedDict, Unpack, get_args

from pydantic import Field

from schemas.base import StrictModel
from schemas.documents import ShardDocument
from schemas.errors import RunFailedError, RunPartialError

RecoveryState = Literal[
    "scored",
    "model_final",
    "judge_recoverable",
    "retryable",
    "exhausted",
    "terminal",
    "missing",
    "masked",
    "omitted",
]
RECOVERY_STATES: tuple[RecoveryState, ...] = get_args(RecoveryState)
RUNNABLE: frozenset[RecoveryState] = frozenset({"retryable", "missing"})
"""The states `rollouts resume` runs: exactly these."""
FAILED: frozenset[RecoveryState] = frozenset(
    {"model_final", "judge_recoverable", "retryable", "exhausted", "terminal"}
)
"""The states whose standing outcome is a failure row (coverage's `failed`)."""

WrittenBy = Literal["finish", "plan", "stop"]


class RunCoverage(ShardDocument, StrictModel):
    """`rollouts-S_coverage.json`: every expected rollout accounted for, in NeMo Gym's names."""

    expected: int
    """Expected rollouts: lines of the materialized inputs."""
    successful: int
    """Rollouts with a result: measured + masked + unscored."""
    measured: int
    """Results with a numeric reward, not masked."""
    masked: int
    """Results with `mask_sample` set: kept as completed, not measured."""
    unscored: int
    """Results without a numeric reward (not zero: left out of the score)."""
    failed: int
    """Rollouts whose standing outcome is a failure row (of any failure state)."""
    intentionally_omitted: int
    """Rollouts left out on purpose (`_ng_omitted` rows)."""
    unknown: int
    """The residual: rollouts with no standing outcome (never run, drained, stopped, killed,
    or dispatched again by a resume that has not written its outcome yet)."""
    complete: bool
    """Every expected rollout completed: a result, a failure scored as zero or an omission."""
    reconciled: bool
    """The counts were read from the shard's files against its materialized inputs (False for the
    provisional account a stop writes from Redis, or without materialized inputs)."""
    scored: int
    """Rollouts in the metrics: results, failures counted as zero and imputed zeros."""
    counted_failures: int
    """Failures settled as scored zeros (state `model_final`)."""
    imputed: int = 0
    """Rollouts with no row scored as zero by `count_missing_rollouts_as_zero` (still unknown)."""
    attempts_exhausted: int
    """Failed rollouts at their attempt limit (state `exhausted`)."""
    max_rollout_attempts: int
    """The attempt limit the states were judged by."""
    attempts: int
    """Attempts on record: one per result and per failure row (omissions and drained rows aside)."""
    identity_verified: bool
    """The materialized inputs are the ones the manifest recorded (their SHA-256)."""
    states: dict[RecoveryState, int] = Field(default_factory=dict)
    """Expected rollouts per recovery state (every state present, zeros included)."""
    failed_by_class: dict[str, int] = Field(default_factory=dict)
    """Failed rollouts by the class of their standing failure row."""
    superseded_records: int = 0
    """Late deliveries of older attempts kept as evidence in the `_superseded` folder, never
    selected (not the stale results a feed's re-runs set aside there)."""
    generation: int = 0
    """The newest dispatch generation of the shard when this was written."""
    written_by: WrittenBy = "finish"
    """`finish` (the finish step), `plan` (`rollouts resume --plan`) or `stop` (a SIGTERM stop)."""
    updated_at: str = ""
    """When it was written."""

    def problems(self) -> list[str]:
        """The invariants it breaks (none, when it is right)."""
        out = []
        if self.successful != self.measured + self.masked + self.unscored:
            out.append("successful != measured + masked + unscored")
        parts = self.successful + self.failed + self.intentionally_omitted + self.unknown
        if self.expected != parts:
            out.append(
                "expected != measured + masked + unscored + failed + intentionally_omitted + unknown"
            )
        if min(self.measured, self.masked, self.unscored, self.failed, self.unknown) < 0:
            out.append("a count is negative")
        if self.states and sum(self.states.values()) != self.expected:
            out.append("the states do not add up to expected")
        return out

    @property
    def completed(self) -> int:
        """Completed samples: results, failures settled as scored zeros, omissions."""
        return self.successful + self.counted_failures + self.intentionally_omitted

    @property
    def runnable(self) -> int:
        """Rollouts `rollouts resume` would run: retryable and missing."""
        return sum(self.states.get(s, 0) for s in RUNNABLE)

    def metrics(self) -> dict[str, int]:
        """The counts as metric entries beside the aggregate metrics (`coverage/<name>`)."""
        names = ("expected", "successful", "measured", "masked", "unscored", "failed",
                 "intentionally_omitted", "unknown", "scored", "counted_failures", "imputed",
                 "attempts_exhausted")  # fmt: skip
        return {f"coverage/{name}": int(getattr(self, name)) for name in names}


class CompletionInputs(TypedDict, total=False):
    """What a strict driver says beside the counts (see `completion_rejection`)."""

    retryable: Required[bool]
    progress: Required[bool]
    final_zero_rows: int
    omitted: int
    where: str
    resume: str | None


def completion_rejection(
    expected: int, completed: int, **inputs: Unpack[CompletionInputs]
) -> RunFailedError | None:
    """The error that rejects unfinished work under `require_complete`, or None when every
    expected rollout completed. Decided before the aggregate, so a rejected run publishes no score.

    `completed`: rollouts with a result; `final_zero_rows` (0): failures settled as scored zeros
    and `omitted` (0): intentional omissions, both completed samples too. A driver must say
    whether any rollout can still run (`retryable`) and whether this invocation saved outcomes
    that made progress (`progress`): only with both is the rejection a `RunPartialError` (exit
    75, a resume can complete it), else it is final (`RunFailedError`, exit 1), so that a
    scheduler that requeues on 75 never restarts a run that has nothing left to run, or makes no
    progress. `where`: the rollouts file; `resume`: the command that runs the rest.
    """
    done = completed + inputs.get("final_zero_rows", 0) + inputs.get("omitted", 0)
    if done >= expected:
        return None
    where = inputs.get("where", "")
    message = (
        f"EVAL FAILED: {done}/{expected} samples completed. Partial artifacts retained at {where}."
    )
    retryable = inputs["retryable"]
    if retryable and inputs["progress"]:
        resume = inputs.get("resume")
        then = f": {resume}" if resume else ""
        return RunPartialError(f"{message} The rest can still run; a resume completes it{then}")
    why = "no rollout is left that can run" if not retryable else "this run made no progress"
    return RunFailedError(f"{message} Final: {why}.")


def raise_for_completion(expected: int, completed: int, **inputs: Unpack[CompletionInputs]) -> None:
    """Raise the strict run's rejection, if any (see `completion_rejection` for the arguments)."""
    error = completion_rejection(expected, completed, **inputs)
    if error is not None:
        raise error


def coverage_rejection(
    coverage: RunCoverage, *, progress: bool, where: str, resume: str | None = None
) -> RunFailedError | None:
    """`completion_rejection` of a shard's coverage: retryable when a resume has rollouts to run."""
    return completion_rejection(
        coverage.expected, coverage.successful, retryable=coverage.runnable > 0, progress=progress,
        final_zero_rows=coverage.counted_failures, omitted=coverage.intentionally_omitted,
        where=where, resume=resume,
    )  # fmt: skip
