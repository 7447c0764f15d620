"""A deterministic example model server, shaped like the OpenAI Responses API (and chat).

`POST /v1/responses` answers with the stand-in model of `examples/tasks.py`: the answer is a
pure function of the question, the rollout index and the hints the example agent passes in the
request's `metadata` (`expected_answer`, `difficulty`, `rollout_index`), so runs reproduce.
`"stream": true` answers as Server-Sent Events (`response.created`, `response.output_text.delta`
per word, `response.completed`). `POST /v1/chat/completions` answers the same in the chat
dialect, streamed too. `--latency-ms` delays each reply; `GET /stats` counts the calls.

A request can ask for a faulty reply in its `metadata` (`"fault"`, for tests of the health
checks): `truncated` (cut by its output limit: `incomplete`, `max_output_tokens`, half of its
text), `empty` (no output, no output tokens), `truncated_empty` (cut with no output at all).

    python -m examples.model_server --port 9301
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

import orjson
from aiohttp import web

from examples.tasks import stand_in_answer, stand_in_response


def _row(body: dict[str, Any]) -> dict[str, Any]:
    """What the stand-in model reads, from the request's input and the agent's hints."""
    found = body.get("metadata")
    hints: dict[str, Any] = found if isinstance(found, dict) else {}
    messages = body.get("input", body.get("messages"))
    row: dict[str, Any] = {"responses_create_params": {"input": messages}}
    if "expected_answer" in hints:
        row["expected_answer"] = hints["expected_answer"]
    if "difficulty" in hints:
        row["difficulty"] = float(hints["difficulty"])
    row["_ng_rollout_index"] = int(hints.get("rollout_index", 0))
    return row


def _usage(body: dict[str, Any], out_tokens: int) -> tuple[int, int]:
    return 12 + len(orjson.dumps(body.get("input", body.get("messages")))) // 8, out_tokens


FAULTS = ("truncated", "empty", "truncated_empty")


def response_object(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses API object answering `body` (faulty when its metadata asks)."""
    answer, out_tokens = stand_in_answer(_row(body))
    in_tokens, out_tokens = _usage(body, out_tokens)
    rid = uuid.uuid4().hex[:16]
    model = str(body.get("model") or "stand-in-1")
    hints = body.get("metadata")
    fault = hints.get("fault") if isinstance(hints, dict) else None
    if fault in ("empty", "truncated_empty"):
        out_tokens = 0 if fault == "empty" else out_tokens
    response = stand_in_response(rid, answer, (in_tokens, out_tokens), model, details=True)
    if fault == "truncated":
        text = response["output"][0]["content"][0]
        text["text"] = text["text"][: max(1, len(text["text"]) // 2)]
    if fault in ("empty", "truncated_empty"):
        response["output"] = []
    if fault in ("truncated", "truncated_empty"):
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ModelServer:
    """State of one example model server."""

    def __init__(self, latency_ms: float = 0.0) -> None:
        self.latency_ms = latency_ms
        self.calls = 0
        self.streamed = 0

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body is not an object"}}, status=400)
        self.calls += 1
        if self.latency_ms > 0:
            await asyncio.sleep(self.latency_ms / 1000)
        return body

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        final = response_object(body)
        if not body.get("stream"):
            return web.json_response(final, dumps=lambda v: orjson.dumps(v).decode())
        self.streamed += 1
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        started = {**final, "status": "in_progress", "output": [], "usage": None}
        await reply.write(
            _sse("response.created", {"type": "response.created", "response": started})
        )
        parts = final["output"][0]["content"] if final["output"] else []
        text = parts[0]["text"] if parts else ""
        for n, word in enumerate(text.split(" ") if text else []):
            delta = {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
                     "delta": word if n == 0 else " " + word}  # fmt: skip
            await reply.write(_sse("response.output_text.delta", delta))
        terminal = (
            "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        )
        await reply.write(_sse(terminal, {"type": terminal, "response": final}))
        await reply.write_eof()
        return reply

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        final = response_object(body)
        text = final["output"][0]["content"][0]["text"] if final["output"] else ""
        usage = final["usage"]
        tokens = {
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
        }
        head = {"id": final["id"], "model": final["model"], "created": final["created_at"]}
        if not body.get("stream"):
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            out = {**head, "object": "chat.completion", "choices": [choice], "usage": tokens}
            return web.json_response(out)
        self.streamed += 1
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for n, word in enumerate(text.split(" ")):
            delta = {"content": word if n == 0 else " " + word}
            chunk = {**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
            await reply.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        last = {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": tokens}  # fmt: skip
        await reply.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        await reply.write_eof()
        return reply

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"calls": self.calls, "streamed": self.streamed})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/stats", self.stats)
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9301)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    a = parser.parse_args()
    web.run_app(ModelServer(a.latency_ms).app(), host=a.host, port=a.port, access_log=None)


if __name__ == "__main__":
    main()
