"""Server-Sent Event streams of the three model dialects, as NeMo Gym's capture reads them.

`sse_events` splits a stream into (event name, data) pairs, `terminal` finds how it ended
(as NeMo Gym 0.7.0's capture: `responses` on `response.completed|incomplete|failed`, `chat` on
`data: [DONE]` or an error chunk, `messages` on `message_stop`; `event: error` in any), and
`reassemble` rebuilds the one object a non-streamed call would have returned.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from pydantic import JsonValue


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each SSE event; data that is not JSON is kept as text."""
    events: list[tuple[str | None, Any]] = []
    for block in re.split(r"\r?\n\r?\n", text):
        name, data = None, []
        for row in block.splitlines():
            if row.startswith("event:"):
                name = row[6:].strip()
            elif row.startswith("data:"):
                data.append(row[5:].lstrip())
        if not data and name is None:
            continue
        raw = "\n".join(data)
        try:
            events.append((name, orjson.loads(raw)))
        except orjson.JSONDecodeError:
            events.append((name, raw))
    return events


def terminal(dialect: str, events: list[tuple[str | None, Any]]) -> str | None:
    """`complete`, `incomplete` or `error` from a stream's terminal event; None when it has none."""
    for name, data in reversed(events):
        kind = name or (data.get("type") if isinstance(data, dict) else None)
        if kind == "error":
            return "error"
        if dialect == "responses" and kind in (
            "response.completed", "response.incomplete", "response.failed",
        ):  # fmt: skip
            return {"response.completed": "complete", "response.incomplete": "incomplete"}.get(
                kind, "error"
            )
        if dialect == "chat":
            if data == "[DONE]":
                return "complete"
            if isinstance(data, dict) and data.get("error") is not None:
                return "error"
        if dialect == "messages" and kind == "message_stop":
            return "complete"
    return None


def reassemble(dialect: str, events: list[tuple[str | None, Any]]) -> dict[str, JsonValue] | None:
    """The final object of a streamed reply."""
    objects = [d for _, d in events if isinstance(d, dict)]
    if dialect == "responses":
        final = [
            d for d in objects
            if d.get("type") in ("response.completed", "response.incomplete", "response.failed")
        ]  # fmt: skip
        found = final or [d for d in objects if isinstance(d.get("response"), dict)]
        return found[-1]["response"] if found else None
    if dialect == "chat":
        return _reassemble_chat(objects)
    return _reassemble_messages(objects)


def _reassemble_chat(chunks: list[dict[str, Any]]) -> dict[str, JsonValue] | None:
    if not chunks:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    tools: dict[int, dict[str, Any]] = {}
    finish, usage, reasoning = None, None, ""
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            message["content"] += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = tools.setdefault(
                    call.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if reasoning:
        message["reasoning_content"] = reasoning
    if tools:
        message["tool_calls"] = [tools[i] for i in sorted(tools)]
    first = chunks[0]
    return {
        "id": first.get("id"),
        "object": "chat.completion",
        "model": first.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
    }


def _reassemble_messages(events: list[dict[str, Any]]) -> dict[str, JsonValue] | None:
    start = next((e["message"] for e in events if e.get("type") == "message_start"), None)
    if not isinstance(start, dict):
        return None
    message = {**start, "content": []}
    usage = dict(start.get("usage") or {})
    for event in events:
        kind = event.get("type")
        if kind == "content_block_start":
            message["content"].append(dict(event.get("content_block") or {}))
        elif kind == "content_block_delta" and message["content"]:
            delta, block = event.get("delta") or {}, message["content"][-1]
            for src, dst in (("text", "text"), ("thinking", "thinking"), ("partial_json", "_json")):
                if src in delta:
                    block[dst] = block.get(dst, "") + delta[src]
        elif kind == "message_delta":
            message.update({k: v for k, v in (event.get("delta") or {}).items() if v is not None})
            usage.update(event.get("usage") or {})
    for block in message["content"]:
        raw = block.pop("_json", None)
        if raw is not None:
            try:
                block["input"] = orjson.loads(raw)
            except orjson.JSONDecodeError:
                block["input"] = raw
    message["usage"] = usage
    return message
