"""The capture proxy's rules as NeMo Gym 0.7.0 states them (docs/how-to/model-call-capture.md):
error categories, stream terminals, and streamed bodies reassembled into one object."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from infra.capture_proxy import Exchange, exception_category, status_category
from infra.sse import reassemble, sse_events, terminal

REF = {"type": "responses_api_models", "name": "policy_model"}


@pytest.mark.parametrize(
    ("status", "category"),
    [(200, None), (399, None), (408, "timeout"), (504, "timeout"), (429, "rate_limit"),
     (401, "auth"), (403, "auth"), (404, "not_found"), (422, "client_error"),
     (500, "upstream_error"), (None, None)],
)  # fmt: skip
def test_status_categories(status: int | None, category: str | None) -> None:
    assert status_category(status) == category


def test_exception_categories() -> None:
    assert exception_category(asyncio.CancelledError()) == "cancelled"
    assert exception_category(TimeoutError()) == "timeout"
    assert exception_category(ConnectionRefusedError()) == "connection"
    assert exception_category(ValueError()) == "exception"


def sse(*events: tuple[str | None, object]) -> str:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        body = data if isinstance(data, str) else orjson.dumps(data).decode()
        out.append(f"{head}data: {body}\n\n")
    return "".join(out)


def test_chat_deltas_are_reassembled() -> None:
    text = sse(
        (None, {"id": "c1", "model": "m", "choices": [{"delta": {"content": "4", "reasoning_content": "hm"}}]}),
        (None, {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}),
        (None, {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3}}),
        (None, "[DONE]"),
    )  # fmt: skip
    events = sse_events(text)
    assert terminal("chat", events) == "complete"
    final: dict[str, Any] | None = reassemble("chat", events)  # read by path below
    assert final is not None
    message = final["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("4", "hm")
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert (final["object"], final["usage"], final["choices"][0]["finish_reason"]) == (
        "chat.completion", {"prompt_tokens": 3}, "stop",
    )  # fmt: skip


def test_messages_blocks_are_reassembled() -> None:
    text = sse(
        ("message_start", {"type": "message_start", "message": {"id": "m1", "usage": {"input_tokens": 5}}}),
        ("content_block_start", {"type": "content_block_start", "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "hi"}}),
        ("content_block_start", {"type": "content_block_start", "content_block": {"type": "tool_use", "id": "t", "name": "f"}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"partial_json": "{\"x\": 2}"}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 7}}),
        ("message_stop", {"type": "message_stop"}),
    )  # fmt: skip
    events = sse_events(text)
    assert terminal("messages", events) == "complete"
    final: dict[str, Any] | None = reassemble("messages", events)
    assert final is not None
    assert final["content"][0]["text"] == "hi" and final["content"][1]["input"] == {"x": 2}
    assert final["usage"] == {"input_tokens": 5, "output_tokens": 7}
    assert final["stop_reason"] == "tool_use"


def test_a_stream_without_its_terminal_event_is_truncated() -> None:
    exchange = Exchange("1-0", "responses", REF, b'{"input": "q"}', None)
    exchange.status, exchange.streamed = 200, True
    exchange.seen(b'event: response.created\ndata: {"type": "response.created"}\n\n')
    line = orjson.loads(exchange.line())
    assert line["error_category"] == "stream_truncated"
    assert line["response_raw"].startswith("event: response.created")


def test_an_incomplete_response_and_a_body_that_is_not_json() -> None:
    exchange = Exchange("1-0", "responses", REF, b"not json", "inv")
    exchange.status, exchange.streamed = 200, True
    incomplete = {"type": "response.incomplete", "response": {"id": "r", "status": "incomplete"}}
    exchange.seen(sse(("response.incomplete", incomplete)).encode())
    line = orjson.loads(exchange.line())
    assert line["error_category"] == "incomplete" and line["response"]["id"] == "r"
    assert line["request"] is None and line["request_raw"] == "not json"
    assert line["client_session_id"] == "inv"
    plain = Exchange("1-0", "responses", REF, b"{}", None)
    plain.status = 200
    plain.seen(b"<html>oops</html>")
    line = orjson.loads(plain.line())
    assert (line["error_category"], line["response"], line["response_raw"]) == (
        "capture_parse_error", None, "<html>oops</html>",
    )  # fmt: skip
