"""A capture file read back: NeMo Gym 0.7.0's `ModelCallRecord`s, their metrics and gaps.

`read_capture` is NeMo Gym's `merge_model_call_capture_into_record` up to the projection
(docs/how-to/model-call-capture.md): the lenient read (blank lines skipped; a line that is not
a JSON object counts as unreadable but still takes its `call_index`), one record per readable
line with its fields in NeMo Gym's order, the sums of `metrics`, and the gaps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

import orjson

NO_RECORDS = "model_call_capture_no_records"
RECORDS_UNREADABLE = "model_call_capture_records_unreadable"
INCOMPLETE = "model_call_capture_incomplete"
UNREADABLE = "model_call_capture_unreadable"
PAYLOAD_KEYS = ("request", "response", "request_raw", "response_raw")


class TokenStats(TypedDict):
    """A response's token counts and cache signal (null: the usage does not say)."""

    tokens_in: int | None
    tokens_out: int | None
    tokens_reasoning: int | None
    tokens_total: int | None
    cached_tokens: int | None
    cache_hit: bool | None
    cache_creation_tokens: int | None


class ModelCallRecord(TypedDict):
    """NeMo Gym's `ModelCallRecord` of one capture line; what the line does not say is null."""

    model_call_id: str | None
    response_id: str | None
    client_session_id: str | None
    call_index: int
    model_ref: dict[str, Any] | None
    model: str | None
    dialect: str | None
    status_code: Any
    response_status: str | None
    finish_reason: str | None
    upstream_attempted: Any
    response_source: Any
    upstream_status_code: Any
    local_response_reason: Any
    started_at: Any
    completed_at: Any
    tokens_in: int | None
    tokens_out: int | None
    tokens_reasoning: int | None
    tokens_total: int | None
    request: Any
    response: Any
    request_raw: Any
    response_raw: Any
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None
    cache_hit: bool | None
    cached_tokens: int | None
    cache_creation_tokens: int | None
    error_category: Any
    latency_total_ms: Any
    latency_ttft_ms: Any


class CaptureMetrics(TypedDict):
    """`ng_model_call_capture.metrics`: sums over the captured calls (null: no call has it)."""

    tokens_in: int | float | None
    tokens_out: int | float | None
    tokens_reasoning: int | float | None
    tokens_total: int | float | None
    cached_tokens: int | float | None
    latency_total_ms: int | float | None
    num_calls: int


class CaptureBlock(TypedDict):
    """`ng_model_call_capture`: the rollout's model-call records, their sums and the gaps."""

    rollout_id: str
    metrics: CaptureMetrics
    calls: list[ModelCallRecord]
    gaps: NotRequired[list[dict[str, Any]]]


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _first_int(*values: Any) -> int | None:
    for value in values:
        found = _int(value)
        if found is not None:
            return found
    return None


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def token_stats(response: Any) -> TokenStats:
    """NeMo Gym's `extract_token_stats` and cache signal over a response's `usage`."""
    usage = as_dict(as_dict(response).get("usage"))
    tokens_in = _first_int(usage.get("input_tokens"), usage.get("prompt_tokens"))
    cache_read = _int(usage.get("cache_read_input_tokens"))
    cache_creation = _int(usage.get("cache_creation_input_tokens"))
    if cache_read is not None or cache_creation is not None:
        extra = (cache_read or 0) + (cache_creation or 0)
        if tokens_in is not None or extra > 0:
            tokens_in = (tokens_in or 0) + extra
    tokens_out = _first_int(usage.get("output_tokens"), usage.get("completion_tokens"))
    total = _int(usage.get("total_tokens"))
    if total is None and tokens_in is not None and tokens_out is not None:
        total = tokens_in + tokens_out
    reasoning = _first_int(
        as_dict(usage.get("output_tokens_details")).get("reasoning_tokens"),
        as_dict(usage.get("completion_tokens_details")).get("reasoning_tokens"),
        usage.get("reasoning_output_tokens"),
    )
    details = as_dict(usage.get("prompt_tokens_details")) or as_dict(
        usage.get("input_tokens_details")
    )
    cached = _first_int(
        details.get("cached_tokens"),
        details.get("cached_input_tokens"),
        cache_read,
        usage.get("cached_input_tokens"),
    )
    return {
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_reasoning": reasoning,
        "tokens_total": total,
        "cached_tokens": cached,
        "cache_hit": None if cached is None else cached > 0,
        "cache_creation_tokens": cache_creation,
    }


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"_raw": raw}


def first_choice(response: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's first choice (an empty object when it has none)."""
    choices = response.get("choices")
    return as_dict(choices[0]) if isinstance(choices, list) and choices else {}


def _tool_calls(response: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "function_call":
            out.append(
                {
                    "call_id": item.get("call_id"),
                    "name": item.get("name"),
                    "arguments": _arguments(item.get("arguments")),
                }
            )
    for call in as_dict(first_choice(response).get("message")).get("tool_calls") or []:
        fn = as_dict(as_dict(call).get("function"))
        out.append(
            {
                "call_id": as_dict(call).get("id"),
                "name": fn.get("name"),
                "arguments": _arguments(fn.get("arguments")),
            }
        )
    content = response.get("content")
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use":
            out.append(
                {
                    "call_id": block.get("id"),
                    "name": block.get("name"),
                    "arguments": block.get("input"),
                }
            )
    return out


def _reasoning(response: dict[str, Any]) -> str | None:
    texts: list[str] = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "reasoning":
            texts += [
                s["text"]
                for s in item.get("summary") or []
                if isinstance(as_dict(s).get("text"), str)
            ]
    message = as_dict(first_choice(response).get("message"))
    chat = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(chat, str):
        texts.append(chat)
    content = response.get("content")
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict) or block.get("type") != "thinking":
            continue
        if isinstance(block.get("thinking"), str):
            texts.append(block["thinking"])
    return "\n".join(texts) if texts else None


def finish_reason(raw: Any) -> str | None:
    """The output's finish reason as NeMo Gym derives it: Anthropic's `stop_reason`, chat's
    `choices[0].finish_reason`, the Responses API's `incomplete_details.reason`."""
    d = as_dict(raw)
    for value in (
        d.get("stop_reason"),
        first_choice(d).get("finish_reason"),
        as_dict(d.get("incomplete_details")).get("reason"),
    ):
        if isinstance(value, str):
            return value
    return None


def model_call_record(line: dict[str, Any], call_index: int) -> ModelCallRecord:
    """One `ModelCallRecord` from one capture line, keys in NeMo Gym's order."""
    request = line.get("request")
    response = line.get("response")
    resp = as_dict(response)
    tokens = token_stats(response)
    return {
        "model_call_id": _str(line.get("model_call_id")),
        "response_id": _str(resp.get("id")),
        "client_session_id": _str(line.get("client_session_id")),
        "call_index": call_index,
        "model_ref": line.get("model_ref") if isinstance(line.get("model_ref"), dict) else None,
        "model": _str(resp.get("model")) or _str(as_dict(request).get("model")),
        "dialect": _str(line.get("dialect")),
        "status_code": line.get("status_code"),
        "response_status": _str(resp.get("status")),
        "finish_reason": finish_reason(resp),
        "upstream_attempted": line.get("upstream_attempted"),
        "response_source": line.get("response_source"),
        "upstream_status_code": line.get("upstream_status_code"),
        "local_response_reason": line.get("local_response_reason"),
        "started_at": line.get("started_at"),
        "completed_at": line.get("completed_at"),
        "tokens_in": tokens["tokens_in"],
        "tokens_out": tokens["tokens_out"],
        "tokens_reasoning": tokens["tokens_reasoning"],
        "tokens_total": tokens["tokens_total"],
        "request": request,
        "response": response,
        "request_raw": line.get("request_raw"),
        "response_raw": line.get("response_raw"),
        "tool_calls": _tool_calls(resp),
        "reasoning_content": _reasoning(resp),
        "cache_hit": tokens["cache_hit"],
        "cached_tokens": tokens["cached_tokens"],
        "cache_creation_tokens": tokens["cache_creation_tokens"],
        "error_category": line.get("error_category"),
        "latency_total_ms": line.get("latency_ms"),
        "latency_ttft_ms": line.get("latency_ttft_ms"),
    }


def _sum(calls: Sequence[Mapping[str, Any]], key: str) -> int | float | None:
    values = [c[key] for c in calls if isinstance(c.get(key), int | float)]
    total = sum(values) if values else None
    return round(total, 2) if isinstance(total, float) else total


def metrics(calls: list[ModelCallRecord]) -> CaptureMetrics:
    """Sums over every captured call; a sum is None when no call has the field."""
    return {
        "tokens_in": _sum(calls, "tokens_in"),
        "tokens_out": _sum(calls, "tokens_out"),
        "tokens_reasoning": _sum(calls, "tokens_reasoning"),
        "tokens_total": _sum(calls, "tokens_total"),
        "cached_tokens": _sum(calls, "cached_tokens"),
        "latency_total_ms": _sum(calls, "latency_total_ms"),
        "num_calls": len(calls),
    }


def parse_capture(
    data: bytes | None, incomplete: bool
) -> tuple[list[ModelCallRecord], list[dict[str, Any]]]:
    """(model-call records, capture gaps) of one capture file's bytes and marker."""
    calls: list[ModelCallRecord] = []
    invalid = 0
    index = 0
    for raw in (data or b"").splitlines():
        if not raw.strip():
            continue
        position, index = index, index + 1
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            invalid += 1
            continue
        if not isinstance(line, dict):
            invalid += 1
            continue
        try:
            calls.append(model_call_record(line, position))
        except Exception:  # an exchange that cannot become a record is unreadable, not fatal
            invalid += 1
    gaps: list[dict[str, Any]] = []
    if not calls and not invalid and not incomplete:
        gaps.append({"code": NO_RECORDS})
    if invalid:
        gaps.append({"code": RECORDS_UNREADABLE, "detail": f"count={invalid}"})
    if incomplete:
        gaps.append({"code": INCOMPLETE})
    return calls, gaps


def capture_block(
    key: str, calls: list[ModelCallRecord], gaps: list[dict[str, Any]]
) -> CaptureBlock:
    """`ng_model_call_capture`: `gaps` only when there are some."""
    block: CaptureBlock = {"rollout_id": key, "metrics": metrics(calls), "calls": calls}
    if gaps:
        block["gaps"] = gaps
    return block


def strip_payloads(block: Mapping[str, Any]) -> None:
    """Drop the payloads from the capture calls once the trajectory holds them."""
    for call in block.get("calls") or []:
        for key in PAYLOAD_KEYS:
            call.pop(key, None)
