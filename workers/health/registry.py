"""The check registry: what each check reads, and how ignored ids are validated.

A check that lacks the evidence it reads is `unobserved` for that record, never healthy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas.errors import UsageError
from schemas.health import ALL_CHECKS, ROLLOUT_CHECKS


@dataclass(frozen=True)
class CheckSpec:
    """One check: its id, the scope it judges and the evidence it reads."""

    id: str
    scope: str
    reads: frozenset[str]


def _spec(id_: str, scope: str, *reads: str) -> CheckSpec:
    return CheckSpec(id_, scope, frozenset(reads))


REGISTRY: tuple[CheckSpec, ...] = (
    _spec("check_execution_error", "rollout", "record"),
    _spec("record_unreadable", "rollout", "record"),
    _spec("rollout_duplicate_identity", "rollout", "record"),
    _spec("rollout_missing_agent_turns", "rollout", "record", "trajectory", "agent_turns"),
    _spec(
        "rollout_ended_on_failed_model_call",
        "rollout",
        "record",
        "trajectory",
        "observed_model_calls",
    ),
    _spec("agent_turn_hollow", "rollout", "record", "trajectory", "agent_turns"),
    _spec("model_call_zero_completion_tokens", "rollout", "record", "trajectory", "owned_calls"),
    _spec("model_call_missing_token_counts", "rollout", "record", "trajectory", "owned_calls"),
    _spec("trajectory_capture_mismatch", "rollout", "record", "trajectory", "owned_calls"),
    _spec("model_call_failed", "rollout", "record", "trajectory", "owned_calls"),
    _spec("rollout_token_count_mismatch", "rollout", "record", "trajectory", "bound_calls"),
    _spec("model_call_runaway_generation", "rollout", "record", "trajectory", "owned_calls"),
    _spec("task_consistently_unhealthy", "task", "repeat_verdicts"),
    _spec("task_no_successful_model_calls", "task", "repeat_digests"),
    _spec("rollout_response_truncated", "rollout", "record", "response"),
    _spec("rollout_response_empty", "rollout", "record", "response"),
    _spec("rollout_context_window_exceeded", "rollout", "record", "step_usage"),
    _spec("run_excessive_failures", "run", "run_accounting"),
)
assert tuple(s.id for s in REGISTRY) == ALL_CHECKS

BY_ID = {s.id: s for s in REGISTRY}
ROLLOUT_INDEX = {check: i for i, check in enumerate(ROLLOUT_CHECKS)}
"""Bit position of each rollout check in a digest's unobserved mask."""


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
