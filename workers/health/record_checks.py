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
from schemas.health import ROLLOUT_CHECKS
from workers.health import response_checks
from workers.health.digest import Digest
from workers.health.registry import mask_of
from workers.health.response_checks import Finding
from workers.health.trajectory import CONTRADICTION_GAPS, Trajectory, TrajectoryInvalid, nonempty
from workers.health.trajectory import has_tool_call as _has_tool_call
from workers.health.trajectory import response_has_content as _has_content

LENGTH_FINISH = frozenset({"length", "max_output_tokens", "max_tokens"})


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def transcript_tokens(record: dict[str, Any]) -> tuple[int | None, int | None]:
    response = record.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None, None
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    completion = usage.get("output_tokens", usage.get("completion_tokens"))
    return _int(prompt), _int(completion)


def _missing_agent_turns(t: Trajectory) -> list[Finding]:
    for turn in t.turns:
        answer = turn.get("answer")
        if nonempty(answer) or nonempty(turn.get("reasoning_content")) or _has_tool_call(answer):
            return []
        if turn.get("model_calls"):
            return []
    return [(None, {"reason": "no agent turn with model activity"})]


def _hollow_turns(t: Trajectory) -> list[Finding]:
    out: list[Finding] = []
    for position, turn in enumerate(t.turns):
        answer = turn.get("answer")
        message = nonempty(answer) or nonempty(turn.get("reasoning_content"))
        if not message and not _has_tool_call(answer):
            out.append(
                (
                    {"turn": turn.get("turn_no", position)},
                    {"reason": "agent turn has no message or tool calls"},
                )
            )
    return out


def _ended_on_failed_call(t: Trajectory) -> list[Finding]:
    """Per model (model_ref type/name), whether its last call failed.

    The last call is known when all of the model's calls failed, or when they all carry
    `started_at` (then it is the latest by start time, then call index); list order alone is
    not trusted.
    """
    groups: dict[str | None, list[Any]] = {}
    for call in t.calls:
        ref = call.model_ref
        key = f"{ref.get('type')}/{ref.get('name')}" if ref is not None else None
        groups.setdefault(key, []).append(call)
    out: list[Finding] = []
    for model, calls in groups.items():
        if all(c.failed for c in calls):
            last = max(calls, key=lambda c: c.call_index)
        elif all(c.started_at is not None for c in calls):
            last = max(calls, key=lambda c: (c.started_at, c.call_index))
        else:
            continue
        if last.failed:
            detail = {
                "model_ref": model,
                "status": last.status_code,
                "error_category": last.error_category,
                "observed_calls": len(calls),
                "successful_calls": sum(1 for c in calls if c.successful),
            }
            out.append((last.locator(last.position), detail))
    return out


def _zero_completion(t: Trajectory) -> list[Finding]:
    return [
        (c.locator(i), {"completion_tokens": 0})
        for i, c in enumerate(t.owned.matched)
        if c.tokens_out == 0 and not isinstance(c.tokens_out, bool)
    ]


def _missing_token_counts(t: Trajectory) -> list[Finding]:
    out: list[Finding] = []
    for i, c in enumerate(t.owned.matched):
        missing = [
            name
            for name, value in (("prompt_tokens", c.tokens_in), ("completion_tokens", c.tokens_out))
            if value is None
        ]
        if missing:
            out.append((c.locator(i), {"missing": missing}))
    return out


def _capture_mismatch(t: Trajectory) -> list[Finding]:
    out: list[Finding] = []
    seen: set[tuple[str, str]] = set()

    def add(kind: str, call_id: str, detail: dict[str, Any]) -> None:
        if (kind, call_id) not in seen:
            seen.add((kind, call_id))
            out.append(({"call_id": call_id}, {"kind": kind, **detail}))

    for ref in t.owned.missing:
        add("missing_captured_call", ref.split(":")[-1], {})
    for ref, count in t.owned.duplicated:
        add("duplicated_captured_call", ref.split(":")[-1], {"count": count})
    for gap in t.contradictions():
        kind = CONTRADICTION_GAPS[gap["code"]]
        call_id = str(gap.get("detail") or "unknown").split(":")[-1]
        add(
            kind,
            call_id,
            {"observation_gap": gap["code"], "invocation_id": gap.get("invocation_id")},
        )
    return out


def _call_failed(t: Trajectory) -> list[Finding]:
    matched = t.owned.matched
    last = max((c.call_index for c in matched), default=None)
    return [
        (
            c.locator(i),
            {
                "status": c.status_code,
                "error_category": c.error_category,
                "terminal": t.owned.complete and c.call_index == last,
            },
        )
        for i, c in enumerate(matched)
        if c.failed
    ]


def _token_mismatch(record: dict[str, Any], t: Trajectory) -> list[Finding]:
    prompt, completion = transcript_tokens(record)
    capture_prompt = sum(_int(c.tokens_in) or 0 for c in t.bound.matched)
    capture_completion = sum(_int(c.tokens_out) or 0 for c in t.bound.matched)
    if prompt == capture_prompt and completion == capture_completion:
        return []
    detail = {
        "transcript_prompt": prompt,
        "transcript_completion": completion,
        "capture_prompt": capture_prompt,
        "capture_completion": capture_completion,
    }
    return [(None, detail)]


def _runaway(t: Trajectory) -> list[Finding]:
    return [
        (c.locator(i), {"finish_reason": c.finish_reason})
        for i, c in enumerate(t.owned.matched)
        if c.finish_reason in LENGTH_FINISH and not _has_content(c.response)
    ]


def _observable(record: dict[str, Any], t: Trajectory) -> dict[str, bool]:
    """Which trajectory checks have the evidence they read, for an observed trajectory."""
    calls = t.calls_observed
    owned = calls and bool(t.owned.matched)
    prompt, completion = transcript_tokens(record)
    bound = (
        calls
        and t.turn_scope_complete
        and t.bound.complete
        and bool(t.bound.matched)
        and prompt is not None
        and completion is not None
        and all(c.tokens_in is not None and c.tokens_out is not None for c in t.bound.matched)
    )
    return {
        "rollout_missing_agent_turns": t.turns_observed,
        "rollout_ended_on_failed_model_call": calls and bool(t.calls),
        "agent_turn_hollow": t.turns_observed,
        "model_call_zero_completion_tokens": owned,
        "model_call_missing_token_counts": owned,
        "trajectory_capture_mismatch": calls and bool(t.owned.references or t.contradictions()),
        "model_call_failed": owned,
        "rollout_token_count_mismatch": bound,
        "model_call_runaway_generation": owned
        and not any(
            c.finish_reason in LENGTH_FINISH and c.response is None for c in t.owned.matched
        ),
    }


TrajectoryCheck = Callable[[dict[str, Any], Trajectory], list[Finding]]
TRAJECTORY_CHECKS: dict[str, TrajectoryCheck] = {
    "rollout_missing_agent_turns": lambda r, t: _missing_agent_turns(t),
    "rollout_ended_on_failed_model_call": lambda r, t: _ended_on_failed_call(t),
    "agent_turn_hollow": lambda r, t: _hollow_turns(t),
    "model_call_zero_completion_tokens": lambda r, t: _zero_completion(t),
    "model_call_missing_token_counts": lambda r, t: _missing_token_counts(t),
    "trajectory_capture_mismatch": lambda r, t: _capture_mismatch(t),
    "model_call_failed": lambda r, t: _call_failed(t),
    "rollout_token_count_mismatch": _token_mismatch,
    "model_call_runaway_generation": lambda r, t: _runaway(t),
}
RESPONSE_CHECKS: dict[str, Callable[[dict[str, Any]], list[Finding] | None]] = {
    "rollout_response_truncated": response_checks.truncated,
    "rollout_response_empty": response_checks.empty,
    "rollout_context_window_exceeded": response_checks.context_window_exceeded,
}
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
        d.capture_prompt += _int(c.tokens_in) or 0
        d.capture_completion += _int(c.tokens_out) or 0
    d.model_call_errors = sum(by_status.values())
    d.errors_by_status = by_status
    if by_status:
        try:
            d.ended_on_error = bool(_ended_on_failed_call(t))
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
    trajectory_checks, response_checks, trajectory_mask = _plan(ignored)
    unobserved: list[str] = []
    if trajectory is None or not trajectory.observed:
        d.unobserved = trajectory_mask
    else:
        observable = _observable(record, trajectory)
        for check in trajectory_checks:
            if not observable[check]:
                unobserved.append(check)
                continue
            _run(d, check, ignored, unobserved, TRAJECTORY_CHECKS[check], record, trajectory)
    for check in response_checks:
        _run(d, check, ignored, unobserved, RESPONSE_CHECKS[check], record)
    d.unobserved |= mask_of(unobserved)
    _stats(d, record, trajectory)
    return d
