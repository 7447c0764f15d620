"""Our three rollout checks: they read the record's own `response` (and step usage), so they work
without model-call capture.

Each returns None when the record lacks the evidence it reads (the check is then `unobserved`),
else its findings as `(locator, detail)` pairs.
"""

from __future__ import annotations

from typing import Any

from workers.health.trajectory import TOOL_CALL_TYPES

Finding = tuple[dict[str, Any] | None, dict[str, Any]]

LENGTH_REASONS = frozenset({"max_output_tokens", "max_tokens", "length"})
CONTEXT_WINDOW_STATUSES = frozenset({"context_window_exceeded", "model_context_window_exceeded"})


def _text_of_part(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        for key in ("text", "refusal"):
            value = part.get(key)
            if isinstance(value, str):
                return value
    return None


def _is_refusal(output: list[Any]) -> bool:
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "refusal" or (
            isinstance(item.get("refusal"), str) and item["refusal"].strip()
        ):
            return True
        content = item.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "refusal" for p in content
        ):
            return True
    return False


def truncated(record: dict[str, Any]) -> list[Finding] | None:
    """A length-limited finish (`incomplete` for max_output_tokens) that is not a refusal.

    It fires whatever content came before the cut: a partial answer is still a cut answer.
    """
    response = record.get("response")
    if not isinstance(response, dict):
        return None
    status = response.get("status")
    details = response.get("incomplete_details")
    if status is None and details is None:
        return None
    reason = details.get("reason") if isinstance(details, dict) else None
    if status not in (None, "incomplete") or reason not in LENGTH_REASONS:
        return []
    output = response.get("output")
    if isinstance(output, list) and _is_refusal(output):
        return []
    return [(None, {"status": status, "reason": reason})]


def _usable(output: list[Any]) -> str | None:
    """None when some item is usable output, else why not: empty, reasoning_only or malformed.

    Read from the end: the answer is the last item of a typical output, after any number of
    reasoning items (the verdict does not depend on the order)."""
    if not output:
        return "empty"
    kinds = set()
    for item in reversed(output):
        if not isinstance(item, dict):
            kinds.add("malformed")
            continue
        kind = item.get("type")
        if kind in TOOL_CALL_TYPES:
            return None
        if kind == "reasoning":
            kinds.add("reasoning")
            continue
        if kind == "message" or "content" in item:
            content = item.get("content")
            if isinstance(content, str):
                parts: list[Any] = [content]
            elif isinstance(content, list):
                parts = content
            else:
                kinds.add("malformed")
                continue
            texts = [t for t in map(_text_of_part, parts) if t is not None]
            if any(t.strip() for t in texts):
                return None
            bad = any(not isinstance(p, dict | str) for p in parts)
            kinds.add("malformed" if bad else "blank")
            continue
        kinds.add("malformed")
    if kinds == {"reasoning"}:
        return "reasoning_only"
    return "malformed" if "malformed" in kinds else "empty"


def empty(record: dict[str, Any]) -> list[Finding] | None:
    """No usable output: nothing, reasoning only, or items that are not readable output."""
    response = record.get("response")
    if not isinstance(response, dict):
        return None
    output = response.get("output")
    if output is None and "output" not in response:
        reason: str | None = "malformed"
    elif not isinstance(output, list):
        reason = "malformed"
    else:
        reason = _usable(output)
    return [] if reason is None else [(None, {"reason": reason})]


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
