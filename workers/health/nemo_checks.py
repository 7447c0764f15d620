"""NeMo Gym 0.7.0's rollout checks over a record's trajectory (reference §4.2, rows 4-12).

Each takes the validated trajectory (and, for the token count, the record) and returns its
findings as `(locator, detail)` pairs; `record_checks` decides which have their evidence.
"""

from __future__ import annotations

from typing import Any

from workers.health.response_checks import Finding
from workers.health.trajectory import CONTRADICTION_GAPS, Trajectory, nonempty
from workers.health.trajectory import has_tool_call as _has_tool_call
from workers.health.trajectory import response_has_content as _has_content

LENGTH_FINISH = frozenset({"length", "max_output_tokens", "max_tokens"})


def int_or_none(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def transcript_tokens(record: dict[str, Any]) -> tuple[int | None, int | None]:
    response = record.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None, None
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    completion = usage.get("output_tokens", usage.get("completion_tokens"))
    return int_or_none(prompt), int_or_none(completion)


def missing_agent_turns(t: Trajectory) -> list[Finding]:
    for turn in t.turns:
        answer = turn.get("answer")
        if nonempty(answer) or nonempty(turn.get("reasoning_content")) or _has_tool_call(answer):
            return []
        if turn.get("model_calls"):
            return []
    return [(None, {"reason": "no agent turn with model activity"})]


def hollow_turns(t: Trajectory) -> list[Finding]:
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


def ended_on_failed_call(t: Trajectory) -> list[Finding]:
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


def zero_completion(t: Trajectory) -> list[Finding]:
    return [
        (c.locator(i), {"completion_tokens": 0})
        for i, c in enumerate(t.owned.matched)
        if c.tokens_out == 0 and not isinstance(c.tokens_out, bool)
    ]


def missing_token_counts(t: Trajectory) -> list[Finding]:
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


def capture_mismatch(t: Trajectory) -> list[Finding]:
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


def call_failed(t: Trajectory) -> list[Finding]:
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


def token_mismatch(record: dict[str, Any], t: Trajectory) -> list[Finding]:
    prompt, completion = transcript_tokens(record)
    capture_prompt = sum(int_or_none(c.tokens_in) or 0 for c in t.bound.matched)
    capture_completion = sum(int_or_none(c.tokens_out) or 0 for c in t.bound.matched)
    if prompt == capture_prompt and completion == capture_completion:
        return []
    detail = {
        "transcript_prompt": prompt,
        "transcript_completion": completion,
        "capture_prompt": capture_prompt,
        "capture_completion": capture_completion,
    }
    return [(None, detail)]


def runaway(t: Trajectory) -> list[Finding]:
    return [
        (c.locator(i), {"finish_reason": c.finish_reason})
        for i, c in enumerate(t.owned.matched)
        if c.finish_reason in LENGTH_FINISH and not _has_content(c.response)
    ]
