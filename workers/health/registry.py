"""The check registry: each check's contract (`CheckSpec`), and how ignored ids are validated.

A check that lacks the evidence it reads is `unobserved` for that record, never healthy. What a
check reads is declared here once; `record_checks` derives each check's observability from it.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.errors import UsageError
from schemas.health import (
    ALL_CHECKS,
    ROLLOUT_CHECKS,
    CheckInput,
    CheckScope,
    CheckSpec,
    CheckSubject,
)

In = CheckInput
ROLLOUT, TASK, RUN = CheckScope.ROLLOUT, CheckScope.TASK, CheckScope.RUN
S = CheckSubject


def _spec(id_: str, scope: CheckScope, subject: CheckSubject, *reads: CheckInput) -> CheckSpec:
    return CheckSpec(id=id_, scope=scope, subject=subject, reads=frozenset(reads))


TRAJ = (In.RECORD, In.TRAJECTORY)
REGISTRY: tuple[CheckSpec, ...] = (
    _spec("check_execution_error", ROLLOUT, S.CHECK_EXECUTION, In.RECORD),
    _spec("record_unreadable", ROLLOUT, S.RECORD, In.RECORD),
    _spec("rollout_duplicate_identity", ROLLOUT, S.ROLLOUT, In.RECORD),
    _spec("rollout_missing_agent_turns", ROLLOUT, S.ROLLOUT, *TRAJ, In.AGENT_TURNS),
    _spec("rollout_ended_on_failed_model_call", ROLLOUT, S.ROLLOUT, *TRAJ, In.OBSERVED_MODEL_CALLS),
    _spec("agent_turn_hollow", ROLLOUT, S.AGENT_TURN, *TRAJ, In.AGENT_TURNS),
    _spec("model_call_zero_completion_tokens", ROLLOUT, S.MODEL_CALL, *TRAJ, In.OWNED_MODEL_CALLS),
    _spec("model_call_missing_token_counts", ROLLOUT, S.MODEL_CALL, *TRAJ, In.OWNED_MODEL_CALLS),
    _spec(
        "trajectory_capture_mismatch", ROLLOUT, S.TRAJECTORY_CAPTURE, *TRAJ, In.OWNED_MODEL_CALLS
    ),
    _spec("model_call_failed", ROLLOUT, S.MODEL_CALL, *TRAJ, In.OWNED_MODEL_CALLS),
    _spec("rollout_token_count_mismatch", ROLLOUT, S.ROLLOUT, *TRAJ, In.BOUND_CALLS),
    _spec("model_call_runaway_generation", ROLLOUT, S.MODEL_CALL, *TRAJ, In.OWNED_MODEL_CALLS),
    _spec("task_consistently_unhealthy", TASK, S.TASK, In.REPEAT_VERDICTS),
    _spec("task_no_successful_model_calls", TASK, S.TASK, In.REPEAT_DIGESTS),
    _spec("rollout_response_truncated", ROLLOUT, S.MODEL_CALL, In.RECORD, In.SELECTED_CALLS),
    _spec("rollout_response_empty", ROLLOUT, S.MODEL_CALL, In.RECORD, In.SELECTED_CALLS),
    _spec("rollout_context_window_exceeded", ROLLOUT, S.STEP, In.RECORD, In.STEP_USAGE),
    _spec("run_excessive_failures", RUN, S.GROUP, In.RUN_ACCOUNTING),
)

BY_ID = {s.id: s for s in REGISTRY}
ROLLOUT_INDEX = {check: i for i, check in enumerate(ROLLOUT_CHECKS)}
"""Bit position of each rollout check in a digest's unobserved mask."""


def validate_registry(registry: tuple[CheckSpec, ...]) -> None:
    """Raise ValueError unless `registry` holds every check id once, in the summary's order, each
    reading what its scope provides."""
    ids = tuple(s.id for s in registry)
    if ids != ALL_CHECKS:
        raise ValueError(f"the registry's ids {ids} are not the checks {ALL_CHECKS}")
    provides = {
        ROLLOUT: frozenset(CheckInput) - {In.REPEAT_VERDICTS, In.REPEAT_DIGESTS, In.RUN_ACCOUNTING},
        TASK: frozenset({In.REPEAT_VERDICTS, In.REPEAT_DIGESTS}),
        RUN: frozenset({In.RUN_ACCOUNTING}),
    }
    for spec in registry:
        if not spec.reads <= provides[spec.scope]:
            extra = sorted(spec.reads - provides[spec.scope])
            raise ValueError(f"{spec.id}: a {spec.scope} check cannot read {', '.join(extra)}")
        if spec.scope is ROLLOUT and In.RECORD not in spec.reads:
            raise ValueError(f"{spec.id}: a rollout check reads its record")
        if (ROLLOUT_INDEX.get(spec.id) is None) != (spec.scope is not ROLLOUT):
            raise ValueError(f"{spec.id}: its scope disagrees with the rollout checks")


validate_registry(REGISTRY)


def normalize_ignored(checks: Iterable[str] | str | None) -> tuple[str, ...]:
    """Split, strip, drop empties and repeats; unknown ids are a usage error (exit 2)."""
    if checks is None:
        return ()
    raw = checks.split(",") if isinstance(checks, str) else list(checks)
    normalized = tuple(dict.fromkeys(c.strip() for c in raw if c and c.strip()))
    unknown = sorted(set(normalized) - set(ALL_CHECKS))
    if unknown:
        raise UsageError(
            f"unknown health check id(s): {', '.join(unknown)} (known: {', '.join(ALL_CHECKS)})"
        )
    return normalized


def mask_of(checks: Iterable[str]) -> int:
    mask = 0
    for check in checks:
        mask |= 1 << ROLLOUT_INDEX[check]
    return mask


def checks_in(mask: int) -> list[str]:
    """The rollout checks whose bits are set, in registry order."""
    return [c for c in ROLLOUT_CHECKS if mask >> ROLLOUT_INDEX[c] & 1]
