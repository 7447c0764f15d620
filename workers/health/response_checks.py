"""Our fault checks: a cut-off or empty model output, and a step that ran out of context.

`rollout_response_truncated` and `rollout_response_empty` judge each selected model call of a
rollout (`select_calls`): a multi-turn rollout's cut or empty intermediate call is found, named
by its call id. A record with no captured call is judged on its own final `response`, so the
checks work without model-call capture. Each check returns None when the record lacks the
evidence it reads (the check is then `unobserved`), else its findings as `(locator, detail)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.capture.records import finish_reason
from workers.health import outputs
from workers.health.trajectory import Call, Trajectory

Finding = tuple[dict[str, Any] | None, dict[str, Any]]

CONTEXT_WINDOW_STATUSES = frozenset({"context_window_exceeded", "model_context_window_exceeded"})


@dataclass(frozen=True, slots=True)
class Selection:
    """The calls of a rollout judged for faults (call ids only: no output text is kept)."""

    calls: tuple[Call, ...]
    """The verified successful raw model responses bound to agent turns, in call order."""

    @property
    def ids(self) -> list[str]:
        return [str(c.model_call_id) for c in self.calls]


def select_calls(t: Trajectory) -> Selection | None:
    """The rollout's selected calls; None when the population is unknown.

    Selected means bound to an agent turn of a complete call scope (every captured call
    observed, the turns' call scope complete, every turn reference matching exactly one call).
    A bound call that failed is a trial matter (`model_call_failed` judges it) and is left out.
    Every other bound call must carry an explicit 2xx/3xx status, a raw response and a call id;
    one that does not makes the population unknown.
    """
    if not (t.calls_observed and t.turn_scope_complete and t.bound.complete):
        return None
    selected = []
    for call in t.bound.matched:
        if call.failed:
            continue
        status = call.status_code
        explicit = type(status) is int and 200 <= status < 400
        if not explicit or call.response is None or not call.model_call_id:
            return None
        selected.append(call)
    return Selection(tuple(selected))


def _final_response(record: dict[str, Any]) -> dict[str, Any] | None:
    response = record.get("response")
    return response if isinstance(response, dict) else None


def _judged(t: Trajectory | None) -> bool:
    """Whether the calls are judged (the record captured some), not its final response."""
    return t is not None and bool(t.calls)


def truncated(
    record: dict[str, Any], t: Trajectory | None, selection: Selection | None
) -> list[Finding] | None:
    """An output cut by its length limit (`incomplete` for max_output_tokens) that is not a
    refusal, whatever content came before the cut: a partial answer is still a cut answer."""
    if _judged(t):
        if selection is None or not selection.calls:
            return None
        return [
            ({"call_id": str(c.model_call_id)}, {"finish_reason": reason})
            for c in selection.calls
            if outputs.cut_off(c.response, reason := _reason(c))
        ]
    response = _final_response(record)
    if response is None:
        return None
    status = response.get("status")
    details = response.get("incomplete_details")
    if status is None and details is None:
        return None
    reason = details.get("reason") if isinstance(details, dict) else None
    if status not in (None, "incomplete") or reason not in outputs.LENGTH_REASONS:
        return []
    output = response.get("output")
    if isinstance(output, list) and outputs.output_is_refusal(output):
        return []
    return [(None, {"status": status, "reason": reason})]


def _reason(call: Call) -> str | None:
    reason = call.finish_reason
    return reason if isinstance(reason, str) else finish_reason(call.response)


def empty(
    record: dict[str, Any], t: Trajectory | None, selection: Selection | None
) -> list[Finding] | None:
    """No usable output: nothing, reasoning only, or items that are not readable output."""
    if _judged(t):
        if selection is None or not selection.calls:
            return None
        found: list[Finding] = []
        for c in selection.calls:
            reason = outputs.unusable(c.response)
            if reason is not None:
                found.append(({"call_id": str(c.model_call_id)}, {"reason": reason}))
        return found
    response = _final_response(record)
    if response is None:
        return None
    output = response.get("output")
    if output is None and "output" not in response:
        why: str | None = "malformed"
    elif not isinstance(output, list):
        why = "malformed"
    else:
        why = outputs.output_unusable(output)
    return [] if why is None else [(None, {"reason": why})]


def context_window_exceeded(record: dict[str, Any]) -> list[Finding] | None:
    """A step recorded as context_window_exceeded in the record's `step_usage`: a signal, not proof.

    Agents that solve a task in sub-steps (NeMo Gym's scicode_agent) record each step's status;
    the status comes from an error-text match or model metadata, so the input may not have been
    clipped.
    """
    steps = record.get("step_usage")
    if not isinstance(steps, list):
        return None
    findings: list[Finding] = []
    for position, step in enumerate(steps):
        if isinstance(step, dict) and step.get("status") in CONTEXT_WINDOW_STATUSES:
            number = step.get("step_number", position)
            findings.append(({"step_number": number}, {"status": step["status"]}))
    return findings
