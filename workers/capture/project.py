"""The capture and the agent's observations projected into `ng_trajectory`, then `ng_perf`.

NeMo Gym 0.7.0's ownership join, trajectory projection and `ng_perf`
(docs/how-to/model-call-capture.md): captured calls are attributed to the agent's invocations (by `x-session-id`, then by the
invocations' own references), turns are derived from the owned calls when the agent sent no
trajectory, and the gaps say what could not be observed. Every trajectory is built through
`schemas.trajectory.TrajectoryRecord`, so it is valid by construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired, TypedDict

from pydantic import ValidationError

from schemas import fields as F
from schemas.trajectory import AgentInvocation, TrajectoryRecord, TrajectoryToolCall

REF_GAPS = ("unmatched", "ambiguous", "conflict")
METADATA_KEYS = (
    "response_id", "model_ref", "model", "dialect", "status_code", "response_status",
    "finish_reason", "upstream_attempted", "response_source", "upstream_status_code",
    "local_response_reason", "error_category", "latency_ttft_ms",
)  # fmt: skip
TOKEN_KEYS = (
    ("prompt_tokens", "tokens_in"),
    ("completion_tokens", "tokens_out"),
    ("reasoning_tokens", "tokens_reasoning"),
    ("total_tokens", "tokens_total"),
    ("cached_tokens", "cached_tokens"),
)
PerfToken = Literal[
    "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens"
]
PERF_TOKENS: tuple[tuple[PerfToken, str], ...] = (
    ("prompt_tokens", "prompt_tokens"),
    ("cached_prompt_tokens", "cached_tokens"),
    ("completion_tokens", "completion_tokens"),
    ("reasoning_tokens", "reasoning_tokens"),
)


class Gap(TypedDict):
    """A trajectory gap: what could not be observed, of which invocation, and a detail."""

    code: str
    invocation_id: str | None
    detail: str | None


class CallRef(TypedDict):
    """A model-call reference as NeMo Gym resolves it: the call's id, server and response id."""

    model_call_id: str | None
    model_ref: dict[str, Any] | None
    response_id: str | None


class ProjectedCall(TypedDict):
    """A captured call as a trajectory's model call: timings, payloads, metadata, tokens."""

    model_call_id: str | None
    started_at: Any
    completed_at: Any
    duration_ms: Any
    request: Any
    response: Any
    response_metadata: dict[str, Any]
    token_stats: dict[str, int]


class Perf(TypedDict):
    """`ng_perf`: turns, tool calls and the owned calls' token sums (each only when known)."""

    num_turns: int
    num_tool_calls: int
    token_observability_coverage: float
    prompt_tokens: NotRequired[int]
    cached_prompt_tokens: NotRequired[int]
    completion_tokens: NotRequired[int]
    reasoning_tokens: NotRequired[int]
    total_latency_ms: NotRequired[float]


def _gap(code: str, detail: str | None = None, invocation: str | None = None) -> Gap:
    return {"code": code, "invocation_id": invocation, "detail": detail}


def _dedupe(gaps: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    seen: set[tuple[Any, Any, Any]] = set()
    out = []
    for gap in gaps:
        key = (gap.get("code"), gap.get("invocation_id"), gap.get("detail"))
        if key not in seen:
            seen.add(key)
            out.append(gap)
    return out


def task_id(row: dict[str, Any]) -> str:
    """NeMo Gym's trajectory identity: `task_id`, `problem_id`, `instance_id`, else the index."""
    for key in ("task_id", "problem_id", "instance_id"):
        if row.get(key) is not None:
            return str(row[key])
    return str(row.get(F.TASK_INDEX))


def _candidates(ref: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]) -> list[int]:
    model_ref, response_id = ref.get("model_ref"), ref.get("response_id")
    if ref.get("model_call_id"):
        return [
            i
            for i, c in enumerate(calls)
            if c.get("model_call_id") == ref["model_call_id"]
            and (model_ref is None or _same_ref(model_ref, c.get("model_ref")))
            and (response_id is None or response_id == c.get("response_id"))
        ]
    return [
        i
        for i, c in enumerate(calls)
        if response_id
        and c.get("response_id") == response_id
        and _same_ref(model_ref, c.get("model_ref"))
    ]


def _same_ref(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return (a.get("type"), a.get("name")) == (b.get("type"), b.get("name"))


def _canonical(call: dict[str, Any]) -> CallRef:
    return {
        "model_call_id": call.get("model_call_id"),
        "model_ref": call.get("model_ref"),
        "response_id": call.get("response_id"),
    }


def join(invocations: list[dict[str, Any]], calls: list[dict[str, Any]]) -> list[Gap]:
    """Attribute captured calls to invocations in place; returns the join's gaps.

    A call whose `client_session_id` is an invocation's id joins it; each reference is then
    resolved to exactly one call (else unmatched/ambiguous), a call claimed twice is a
    conflict, and every call left unowned is an ownership gap.
    """
    gaps: list[Gap] = []
    for inv in invocations:
        refs = inv.setdefault("model_calls", [])
        ids = {r.get("model_call_id") for r in refs}
        for call in calls:
            session = call.get("client_session_id")
            if session and session == inv["invocation_id"] and call.get("model_call_id") not in ids:
                refs.append({"model_call_id": call.get("model_call_id")})
    owner: dict[int, str] = {}
    for inv in invocations:
        resolved = []
        for ref in inv["model_calls"]:
            found = _candidates(ref, calls)
            label = str(ref.get("model_call_id") or ref.get("response_id"))
            if len(found) != 1:
                kind = "unmatched" if not found else "ambiguous"
                gaps.append(_gap(f"model_call_reference_{kind}", label, inv["invocation_id"]))
                resolved.append(ref)
                continue
            if found[0] in owner and owner[found[0]] != inv["invocation_id"]:
                gaps.append(_gap("model_call_reference_conflict", label, inv["invocation_id"]))
                continue
            owner[found[0]] = inv["invocation_id"]
            resolved.append(_canonical(calls[found[0]]))
        inv["model_calls"] = resolved
    for i, call in enumerate(calls):
        if i not in owner:
            name = call.get("model_call_id") or call.get("response_id") or "unknown"
            detail = f"capture:{name}:call_index={call.get('call_index', i)}"
            gaps.append(_gap("model_call_ownership_unavailable", detail))
    return gaps


def _projected(call: dict[str, Any]) -> ProjectedCall:
    def payload(key: str) -> Any:
        value = call.get(key)
        return value if value is not None else call.get(f"{key}_raw")

    return {
        "model_call_id": call.get("model_call_id"),
        "started_at": call.get("started_at"),
        "completed_at": call.get("completed_at"),
        "duration_ms": call.get("latency_total_ms"),
        "request": payload("request"),
        "response": payload("response"),
        "response_metadata": {k: call[k] for k in METADATA_KEYS if call.get(k) is not None},
        "token_stats": {
            name: call[key]
            for name, key in TOKEN_KEYS
            if type(call.get(key)) is int and call[key] >= 0
        },
    }


def _question(request: Any) -> Any:
    if not isinstance(request, dict):
        return None
    items = request.get("input")
    if isinstance(items, list):
        return [
            {**i, "type": "message"}
            if isinstance(i, dict) and "role" in i and "type" not in i
            else i
            for i in items
        ]
    return items if items is not None else request.get("messages")


def _answer(response: Any) -> tuple[Any, Any]:
    """(answer, reasoning) of a response: Responses output items, else the chat message."""
    if not isinstance(response, dict):
        return None, None
    if isinstance(response.get("output"), list):
        items = response["output"]
        reasoning = [i for i in items if isinstance(i, dict) and i.get("type") == "reasoning"]
        answer = [i for i in items if not (isinstance(i, dict) and i.get("type") == "reasoning")]
        return answer, reasoning or None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = dict(choices[0].get("message") or {})
        reasoning = message.pop("reasoning_content", None) or message.pop("reasoning", None)
        return message, reasoning
    return None, None


def _turns(
    invocations: list[dict[str, Any]],
    calls: list[dict[str, Any]],
    tool_calls: list[dict[str, Any]],
    ids: dict[str, str],
    resolved: Any,
) -> list[dict[str, Any]]:
    by_id = {c["model_call_id"]: c for c in calls if c.get("model_call_id")}
    turns: list[dict[str, Any]] = []
    for inv in invocations:
        number = 0
        for ref in inv.get("model_calls") or []:
            call = by_id.get(ref.get("model_call_id"))
            if call is None or call.get("response") is None:
                continue
            number += 1
            at = call.get("started_at") or call.get("completed_at") or 0.0
            answer, reasoning = _answer(call["response"])
            before = sum(
                1
                for t in tool_calls
                if t["invocation_id"] == inv["invocation_id"]
                and t.get("started_at") is not None
                and t["started_at"] < at
            )
            turns.append(
                {
                    "invocation_id": inv["invocation_id"],
                    **ids,
                    "turn_no": number,
                    "timestamp": float(at),
                    "step_count": before,
                    "question": _question(call.get("request")),
                    "answer": answer,
                    "reasoning_content": reasoning,
                    "model_calls": [ref],
                }
            )
    turns.sort(key=lambda t: (t["timestamp"], t["invocation_id"], t["turn_no"]))
    if turns and isinstance(resolved, bool):
        turns[-1]["resolved"] = resolved
    return turns


def _observations(
    result: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Mapping[str, Any]]]:
    """(invocations, tool calls, gaps) of the agent's `ng_agent_observations`, validated."""
    bundle = result.get("ng_agent_observations")
    if bundle is None:
        return [], [], []
    try:
        if not isinstance(bundle, dict) or not isinstance(bundle.get("source"), str):
            raise ValueError("ng_agent_observations needs a source")
        invocations, tools = [], []
        for rec in bundle.get("records") or []:
            kind = rec.get("kind") if isinstance(rec, dict) else None
            if kind == "agent_invocation":
                invocations.append(AgentInvocation.model_validate(rec).model_dump(mode="json"))
            elif kind == "tool_call":
                tools.append(TrajectoryToolCall.model_validate(rec).model_dump(mode="json"))
        ids = [i["invocation_id"] for i in invocations]
        if len(ids) != len(set(ids)):
            raise ValueError("invocation_id must be unique within a bundle")
        gaps: list[Mapping[str, Any]] = [g for g in bundle.get("gaps") or [] if isinstance(g, dict)]
        return invocations, tools, gaps
    except (ValidationError, ValueError, AttributeError) as exc:
        return [], [], [_gap("agent_observations_invalid", type(exc).__name__)]


def trajectory(
    row: dict[str, Any], result: dict[str, Any], key: str, capture: Mapping[str, Any] | None
) -> TrajectoryRecord:
    """The rollout's `ng_trajectory` (raises when it cannot be built)."""
    ids = {"task_id": task_id(row), "rollout_id": key}
    invocations, tool_calls, gaps = _observations(result)
    calls: list[dict[str, Any]] = list((capture or {}).get("calls") or [])
    gaps += join(invocations, calls)
    producer = result.get("ng_trajectory")
    model_calls: list[Mapping[str, Any]] = []
    producer_calls: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    if isinstance(producer, dict):
        try:
            given = TrajectoryRecord.model_validate(producer).model_dump(mode="json")
        except ValidationError as exc:
            gaps.append(_gap("producer_trajectory_invalid", type(exc).__name__))
            producer = None
        else:
            differ = [k for k in ("task_id", "rollout_id") if given[k] != ids[k]]
            if differ:
                gaps.append(_gap("producer_trajectory_identity_mismatch", ",".join(differ)))
            turns = [{**t, **ids} for t in given["turns"]]
            gaps += given["gaps"]
            known = {i["invocation_id"] for i in invocations}
            invocations += [i for i in given["invocations"] if i["invocation_id"] not in known]
            tool_calls += given["tool_calls"]
            producer_calls = given["model_calls"]
            model_calls = list(producer_calls)
    producer_ids = {c.get("model_call_id"): c for c in producer_calls if c.get("model_call_id")}
    for call in map(_projected, calls):
        mine = producer_ids.get(call["model_call_id"])
        if mine is None:
            model_calls.append(call)
        else:
            mine.update({k: v for k, v in call.items() if v is not None})
    for gap in (capture or {}).get("gaps") or []:
        gaps.append(_gap(gap["code"], gap.get("detail"), gap.get("invocation_id")))
    if not isinstance(producer, dict):
        turns = _turns(invocations, calls, tool_calls, ids, result.get("resolved"))
    if not model_calls:
        gaps.append(_gap("model_calls_unavailable"))
    if not turns and not isinstance(producer, dict):
        gaps.append(_gap("turns_unavailable"))
    if not any(i.get("conversation") for i in invocations):
        gaps.append(_gap("conversation_unavailable"))
    return TrajectoryRecord.model_validate(
        {
            **ids,
            "invocations": invocations,
            "turns": turns,
            "model_calls": model_calls,
            "tool_calls": tool_calls,
            "gaps": _dedupe(gaps),
        }
    )


def perf(t: dict[str, Any], run_latency_ms: float | None) -> Perf | None:
    """`ng_perf` over the calls the invocations own; None without invocations."""
    invocations = t["invocations"]
    if not invocations:
        return None
    calls = t["model_calls"]
    claimed: set[int] = set()
    num_turns = 0
    for inv in invocations:
        owned = 0
        for ref in inv["model_calls"]:
            found = _candidates(ref, [_flat(c) for c in calls])
            if len(found) == 1 and found[0] not in claimed:
                claimed.add(found[0])
                owned += 1
        turns = sum(1 for turn in t["turns"] if turn["invocation_id"] == inv["invocation_id"])
        num_turns += turns or owned or 1
    names = {i["invocation_id"] for i in invocations}
    out: Perf = {
        "num_turns": num_turns,
        "num_tool_calls": sum(1 for c in t["tool_calls"] if c["invocation_id"] in names),
        "token_observability_coverage": min(1.0, len(claimed) / num_turns),
    }
    for name, key in PERF_TOKENS:
        values = [calls[i]["token_stats"].get(key) for i in sorted(claimed)]
        known = [v for v in values if v is not None]
        if known:
            out[name] = sum(known)
    if run_latency_ms is not None:
        out["total_latency_ms"] = float(run_latency_ms)
    return out


def _flat(call: dict[str, Any]) -> CallRef:
    meta = call.get("response_metadata") or {}
    return {
        "model_call_id": call.get("model_call_id"),
        "model_ref": meta.get("model_ref"),
        "response_id": meta.get("response_id"),
    }
