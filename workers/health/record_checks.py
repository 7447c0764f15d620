"""Every rollout-level check on one record, giving its digest (findings, unobserved checks, stats).

NeMo Gym 0.7.0's rule set (docs/reference/health-checks.md): an unreadable line fires only `record_unreadable`
and leaves every other check unobserved; a check whose evidence is missing is unobserved; a
check that raises is unobserved and adds a `check_execution_error` finding. The duplicate check
is judged later, across records (it needs them all).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from infra import jsonl
from schemas.health import ROLLOUT_CHECKS, CheckInput
from workers.health import response_checks
from workers.health.digest import Digest
from workers.health.nemo_checks import (
    LENGTH_FINISH,
    call_failed,
    capture_mismatch,
    ended_on_failed_call,
    hollow_turns,
    int_or_none,
    missing_agent_turns,
    missing_token_counts,
    runaway,
    token_mismatch,
    transcript_tokens,
    zero_completion,
)
from workers.health.registry import BY_ID, mask_of
from workers.health.response_checks import Finding
from workers.health.trajectory import Trajectory, TrajectoryInvalid


def _bound_tokens(record: dict[str, Any], t: Trajectory) -> bool:
    """The token mismatch's own precondition: transcript usage and every matched call's tokens."""
    prompt, completion = transcript_tokens(record)
    return (
        prompt is not None
        and completion is not None
        and all(c.tokens_in is not None and c.tokens_out is not None for c in t.bound.matched)
    )


def _available(t: Trajectory) -> dict[CheckInput, bool]:
    """Which evidence an observed trajectory provides to the checks that read it."""
    calls = t.calls_observed
    return {
        CheckInput.RECORD: True,
        CheckInput.TRAJECTORY: t.observed,
        CheckInput.AGENT_TURNS: t.turns_observed,
        CheckInput.OBSERVED_MODEL_CALLS: calls and bool(t.calls),
        CheckInput.OWNED_MODEL_CALLS: calls and bool(t.owned.matched),
        CheckInput.BOUND_CALLS: calls
        and t.turn_scope_complete
        and t.bound.complete
        and bool(t.bound.matched),
    }


# NeMo Gym's preconditions beyond what a check reads (reference §4.1, steps 4-6).
PRECONDITIONS: dict[str, Callable[[dict[str, Any], Trajectory], bool]] = {
    "trajectory_capture_mismatch": lambda r, t: (
        t.calls_observed and bool(t.owned.references or t.contradictions())
    ),
    "rollout_token_count_mismatch": _bound_tokens,
    "model_call_runaway_generation": lambda r, t: (
        not any(c.finish_reason in LENGTH_FINISH and c.response is None for c in t.owned.matched)
    ),
}
REPLACES_READS = frozenset({"trajectory_capture_mismatch"})
"""Checks whose precondition stands in for the availability of the binding they read."""


def _observable(
    check: str, record: dict[str, Any], t: Trajectory, available: dict[CheckInput, bool]
) -> bool:
    """Whether `check` has the evidence it reads (its registry `reads`) and NeMo Gym's extra
    preconditions hold."""
    extra = PRECONDITIONS.get(check)
    if check not in REPLACES_READS and not all(available[i] for i in READS[check]):
        return False
    return extra is None or extra(record, t)


TrajectoryCheck = Callable[[dict[str, Any], Trajectory], list[Finding]]
TRAJECTORY_CHECKS: dict[str, TrajectoryCheck] = {
    "rollout_missing_agent_turns": lambda r, t: missing_agent_turns(t),
    "rollout_ended_on_failed_model_call": lambda r, t: ended_on_failed_call(t),
    "agent_turn_hollow": lambda r, t: hollow_turns(t),
    "model_call_zero_completion_tokens": lambda r, t: zero_completion(t),
    "model_call_missing_token_counts": lambda r, t: missing_token_counts(t),
    "trajectory_capture_mismatch": lambda r, t: capture_mismatch(t),
    "model_call_failed": lambda r, t: call_failed(t),
    "rollout_token_count_mismatch": token_mismatch,
    "model_call_runaway_generation": lambda r, t: runaway(t),
}
READS = {
    check: BY_ID[check].reads - {CheckInput.RECORD, CheckInput.TRAJECTORY}
    for check in TRAJECTORY_CHECKS
}
ResponseCheck = Callable[
    [dict[str, Any], Trajectory | None, response_checks.Selection | None], list[Finding] | None
]
RESPONSE_CHECKS: dict[str, ResponseCheck] = {
    "rollout_response_truncated": response_checks.truncated,
    "rollout_response_empty": response_checks.empty,
    "rollout_context_window_exceeded": lambda r, t, s: response_checks.context_window_exceeded(r),
}
FAULT_CHECKS = frozenset({"rollout_response_truncated", "rollout_response_empty"})
_plans: dict[frozenset[str], tuple[list[str], list[str], int]] = {}


def _plan(ignored: frozenset[str]) -> tuple[list[str], list[str], int]:
    """(trajectory checks, response checks) not ignored, and the mask of the former."""
    found = _plans.get(ignored)
    if found is None:
        trajectory = [c for c in TRAJECTORY_CHECKS if c not in ignored]
        response = [c for c in RESPONSE_CHECKS if c not in ignored]
        found = _plans[ignored] = (trajectory, response, mask_of(trajectory))
    return found


def unreadable_digest(error: str, ignored: frozenset[str]) -> Digest:
    """A line that is not a JSON object: only `record_unreadable` is judged."""
    d = Digest(task=None, rollout=0, stage=None, unreadable=True)
    d.unobserved = mask_of(
        c for c in ROLLOUT_CHECKS if c != "record_unreadable" and c not in ignored
    )
    if "record_unreadable" not in ignored:
        d.findings.append(
            ("record_unreadable", None, {"reason": "rollout record is unreadable", "error": error})
        )
    return d


def _stats(d: Digest, record: dict[str, Any], t: Trajectory | None) -> None:
    prompt, completion = transcript_tokens(record)
    d.transcript_prompt, d.transcript_completion = prompt or 0, completion or 0
    reward = record.get("reward")
    d.scored = isinstance(reward, int | float) and not isinstance(reward, bool)
    if t is None or not t.observed:
        return
    d.capture_observed = bool(t.calls)
    d.policy_calls_observed = t.turn_scope_complete and t.bound.complete
    d.model_calls = len(t.bound.matched)
    d.successful_model_calls = sum(1 for c in t.bound.matched if c.successful)
    by_status: dict[str, int] = {}
    for c in t.calls:
        if c.failed:
            status = str(c.status_code) if c.status_code is not None else "unknown"
            by_status[status] = by_status.get(status, 0) + 1
        d.capture_prompt += int_or_none(c.tokens_in) or 0
        d.capture_completion += int_or_none(c.tokens_out) or 0
    d.model_call_errors = sum(by_status.values())
    d.errors_by_status = by_status
    if by_status:
        try:
            d.ended_on_error = bool(ended_on_failed_call(t))
        except Exception:  # the check itself reports this as check_execution_error
            d.ended_on_error = False
    if len(t.calls) > 1:
        identities = Counter(c.identity for c in t.calls if c.identity is not None)
        d.duplicated_calls = sum(n - 1 for n in identities.values() if n > 1)


def _run(
    d: Digest,
    check: str,
    ignored: frozenset[str],
    unobserved: list[str],
    fn: Callable[..., list[Finding] | None],
    *args: Any,
) -> None:
    """One check on the record: its findings, or unobserved (no evidence, or the check raised)."""
    try:
        found = fn(*args)
    except Exception as exc:  # a check's bug must not hide the record's other findings
        unobserved.append(check)
        if "check_execution_error" not in ignored:
            detail = {
                "reason": "check raised an unexpected exception",
                "failed_check": check,
                "error": type(exc).__name__,
            }
            d.findings.append(("check_execution_error", None, detail))
        return
    if found is None:
        unobserved.append(check)
    else:
        d.findings.extend((check, locator, detail) for locator, detail in found)


def check_line(line: bytes | memoryview, ignored: frozenset[str]) -> Digest:
    """The digest of one non-blank line of a rollouts file."""
    try:
        record = jsonl.loads(line)
    except jsonl.JSONDecodeError:
        record = jsonl.UNPARSED
    return check_parsed(record, ignored)


def check_parsed(record: Any, ignored: frozenset[str]) -> Digest:
    """The digest of one non-blank line, from what `jsonl.loads` made of it (`jsonl.UNPARSED`:
    it raised)."""
    if record is jsonl.UNPARSED:
        return unreadable_digest("JSONDecodeError", ignored)
    if not isinstance(record, dict):
        return unreadable_digest("ValueError", ignored)
    return check_record(record, ignored)


def check_record(record: dict[str, Any], ignored: frozenset[str]) -> Digest:
    """Every rollout check on one parsed record."""
    d = Digest(
        task=record.get("_ng_task_index"),
        rollout=record.get("_ng_rollout_index", 0),
        stage=record.get("stage_index"),
    )
    trajectory: Trajectory | None = None
    raw = record.get("ng_trajectory")
    if raw is not None:
        try:
            trajectory = Trajectory(raw)
        except TrajectoryInvalid:
            if "record_unreadable" not in ignored:
                detail = {
                    "reason": "canonical trajectory is unreadable",
                    "error": "ValidationError",
                }
                d.findings.append(("record_unreadable", None, detail))
    explicit = record.get("_ng_rollout_id")
    if explicit is None and trajectory is not None:
        explicit = trajectory.rollout_id
    d.rollout_id = None if explicit is None else str(explicit)
    trajectory_checks, ours, trajectory_mask = _plan(ignored)
    unobserved: list[str] = []
    if trajectory is None or not trajectory.observed:
        d.unobserved = trajectory_mask
    else:
        available = _available(trajectory)
        for check in trajectory_checks:
            if not _observable(check, record, trajectory, available):
                unobserved.append(check)
                continue
            _run(d, check, ignored, unobserved, TRAJECTORY_CHECKS[check], record, trajectory)
    selection = None
    if trajectory is not None and trajectory.calls and FAULT_CHECKS.intersection(ours):
        selection = response_checks.select_calls(trajectory)
        if selection is not None:
            d.selected = selection.ids
    before = len(d.findings)
    for check in ours:
        _run(d, check, ignored, unobserved, RESPONSE_CHECKS[check], record, trajectory, selection)
    if d.selected is not None:
        d.faulted = list(
            dict.fromkeys(
                loc["call_id"]
                for c, loc, _ in d.findings[before:]
                if c in FAULT_CHECKS and loc is not None
            )
        )
    d.unobserved |= mask_of(unobserved)
    _stats(d, record, trajectory)
    return d
