"""`rollouts capture-proxy`: a reverse proxy that captures model calls as NeMo Gym's model server does.

Put it in front of any OpenAI-compatible model server (vLLM, SGLang, a hosted API, the example
model server) and point agents at `http://proxy/ng-rollout/<key>/v1`: the proxy strips the
prefix (and NeMo Gym's `/training-token-capture` segment), forwards the call and appends one
line for it to `<key>.capture.jsonl` in the capture dir, in NeMo Gym 0.7.0's format. Only
`/v1/responses`, `/v1/chat/completions` and `/v1/messages` are captured; other prefixed paths
and unprefixed calls pass through uncaptured.

Responses are streamed through as they arrive, one chunk behind: the chunk that ends the body is
held until the capture line is written (in a thread), so a caller that has seen the end of a
response can count on its capture being stored. A write that fails touches the key's
`.capture.incomplete` marker. The proxy keeps one copy of each body in flight (the capture line
needs it) and nothing after the call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import orjson
from aiohttp import web
from pydantic import JsonValue

from infra import telemetry
from infra.capture import CaptureStore, valid_key
from infra.sse import reassemble, sse_events, terminal

log = logging.getLogger(__name__)

PREFIX = re.compile(r"^/ng-rollout/([^/]+)(?:/training-token-capture)?(/.*)$")


class Route(NamedTuple):
    """A captured path: the dialect its calls speak, and the name of NeMo Gym's model-server
    span for one of them."""

    dialect: str
    span: str


OBSERVED = {
    "/v1/responses": Route("responses", "gym.model.responses"),
    "/v1/chat/completions": Route("chat", "gym.model.chat_completions"),
    "/v1/messages": Route("messages", "gym.model.messages"),
}
HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        "content-encoding",
    }
)  # fmt: skip
KEEP_ALIVE = b": keep-alive\n\n"
DEFAULT_MODEL_NAME = "policy_model"


def status_category(status: int | None) -> str | None:
    """NeMo Gym's `_classify_status`."""
    if status is None or status < 400:
        return None
    if status in (408, 504):
        return "timeout"
    if status == 429:
        return "rate_limit"
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "not_found"
    return "client_error" if status < 500 else "upstream_error"


def exception_category(exc: BaseException) -> str:
    """NeMo Gym's `_classify_exception`."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    name = type(exc).__name__.lower()
    if isinstance(exc, asyncio.TimeoutError) or "timeout" in name:
        return "timeout"
    return "connection" if "conn" in name else "exception"


@dataclass
class Exchange:
    """One model call going through the proxy, and what its capture line will say."""

    key: str
    dialect: str
    model_ref: dict[str, str]
    body: bytes
    session: str | None
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    ttft_ms: float | None = None
    status: int | None = None
    streamed: bool = False
    chunks: list[bytes] = field(default_factory=list)
    completed_at: float | None = None
    latency_ms: float | None = None

    def seen(self, chunk: bytes) -> None:
        if self.ttft_ms is None and chunk and chunk != KEEP_ALIVE:
            self.ttft_ms = round((time.perf_counter() - self.t0) * 1000, 2)
        self.chunks.append(chunk)

    def finish(self) -> None:
        """The call is over: its end time and latency (the line may be built later, off the loop)."""
        if self.completed_at is None:
            self.completed_at = time.time()
            self.latency_ms = round((time.perf_counter() - self.t0) * 1000, 2)

    def line(self, exc: BaseException | None = None) -> bytes:
        """The capture line, NeMo Gym's fields in its order."""
        self.finish()
        out: dict[str, Any] = {
            "model_call_id": uuid.uuid4().hex,
            "dialect": self.dialect,
            "model_ref": self.model_ref,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "latency_ms": self.latency_ms,
            "latency_ttft_ms": self.ttft_ms,
            "status_code": self.status,
        }
        request = _json_object(self.body)
        body = b"".join(self.chunks)
        category = status_category(self.status)
        response: Any = None
        raw: str | None = None
        if self.streamed:
            raw = body.decode("utf-8", "replace")
            events = sse_events(raw)
            response = reassemble(self.dialect, events)
            end = terminal(self.dialect, events)
            if category is None:
                category = {"error": "upstream_error", "incomplete": "incomplete"}.get(
                    end or "", "stream_truncated" if end is None else None
                )
        elif body:
            response = _json_object(body)
            if response is None:
                raw = body.decode("utf-8", "replace")
        if category is None and body and response is None and exc is None:
            category = "capture_parse_error"
        if exc is not None:
            response = None
            raw = body.decode("utf-8", "replace") if body else None
            category = category or exception_category(exc)
        out["error_category"] = category
        out["request"] = request
        out["response"] = response
        if self.session is not None:
            out["client_session_id"] = self.session
        if request is None:
            out["request_raw"] = self.body.decode("utf-8", "replace")
        if raw is not None:
            out["response_raw"] = raw
        return orjson.dumps(out, default=str) + b"\n"


TERMINAL_MARKS = (
    b"response.completed", b"response.incomplete", b"response.failed", b"event: error",
    b"[DONE]", b"message_stop", b'"error"',
)  # fmt: skip


def _ends(chunk: bytes) -> bool:
    """Whether a stream chunk may hold a terminal event: from there on it waits for the capture."""
    return any(mark in chunk for mark in TERMINAL_MARKS)


def _json_object(data: bytes) -> dict[str, JsonValue] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _session(request: web.Request) -> str | None:
    values = {v for v in request.headers.getall("x-session-id", []) if v}
    return values.pop() if len(values) == 1 else None


class CaptureProxy:
    """The proxy's state: the upstream, the capture store, one client session."""

    def __init__(
        self, upstream: str, capture_dir: str, model_name: str = DEFAULT_MODEL_NAME
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.store = CaptureStore(capture_dir)
        self.model_ref = {"type": "responses_api_models", "name": model_name}
        self.session: aiohttp.ClientSession | None = None
        self.captured = 0
        self.write_failures = 0

    async def _client(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path, key = request.path, None
        matched = PREFIX.match(path)
        if matched is not None:
            key, path = matched.group(1), matched.group(2)
        route = OBSERVED.get(path)
        dialect = None if route is None else route.dialect
        if route is None or telemetry.tracer() is None:
            return await self._handle(request, path, key, dialect)
        # A model call of a traced rollout: NeMo Gym's model-server span, then the upstream call.
        attrs = {"http.request.method": request.method, "url.path": request.path}
        if key is not None:
            attrs[telemetry.ROLLOUT_ID] = key
        with telemetry.served(
            route.span, request.headers.get(telemetry.TRACEPARENT), attrs
        ) as span:
            reply = await self._handle(request, path, key, dialect)
            span.status(reply.status)
            return reply

    async def _handle(
        self, request: web.Request, path: str, key: str | None, dialect: str | None
    ) -> web.StreamResponse:
        body = await request.read()
        exchange = None
        if key is not None and dialect is not None and valid_key(key):
            exchange = Exchange(key, dialect, self.model_ref, body, _session(request))
        elif key is not None and dialect is not None:
            log.warning("capture key %r is not a valid key: the call is not captured", key)
        url = self.upstream + path + (f"?{request.query_string}" if request.query_string else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        client = await self._client()
        reply: web.StreamResponse | None = None
        with telemetry.client_span(request.method, url) as call:
            try:
                # The upstream call's `traceparent` replaces the caller's, if traced.
                headers = call.headers(headers)
                async with client.request(request.method, url, data=body, headers=headers) as up:
                    call.status(up.status)
                    reply = web.StreamResponse(status=up.status, reason=up.reason)
                    for name, value in up.headers.items():
                        if name.lower() not in HOP_HEADERS:
                            reply.headers.add(name, value)
                    if exchange is not None:
                        exchange.status = up.status
                        exchange.streamed = up.content_type == "text/event-stream"
                    await reply.prepare(request)
                    streamed = exchange is not None and exchange.streamed
                    held: list[bytes] = []
                    tail = b""  # a terminal event's name may be split across two chunks
                    async for chunk in up.content.iter_any():
                        if exchange is not None:
                            exchange.seen(chunk)
                        ends = streamed and _ends(tail + chunk)
                        tail = chunk[-32:]
                        if exchange is None or (streamed and not held and not ends):
                            await reply.write(chunk)  # passed on as it came
                            continue
                        if not streamed and held:
                            await reply.write(held.pop())  # a JSON body goes one chunk behind
                        held.append(chunk)
                    if exchange is not None:
                        await self._record(exchange)
                    for chunk in held:
                        await reply.write(chunk)
                    await reply.write_eof()
                    return reply
            except (TimeoutError, aiohttp.ClientError, asyncio.CancelledError) as exc:
                call.failed(exc)
                if exchange is not None:
                    await asyncio.shield(self._record(exchange, exc))
                if isinstance(exc, asyncio.CancelledError) or (
                    reply is not None and reply.prepared
                ):
                    raise
                return web.Response(status=502, text=f"upstream call failed: {type(exc).__name__}")

    def _write(self, exchange: Exchange, exc: BaseException | None) -> None:
        self.store.append(exchange.key, exchange.line(exc))

    async def _record(self, exchange: Exchange, exc: BaseException | None = None) -> None:
        exchange.finish()
        try:
            # Parsing the bodies and the fsync both run in a thread: the loop keeps streaming.
            await asyncio.to_thread(self._write, exchange, exc)
            self.captured += 1
        except Exception as err:  # the call goes on; the capture says it is incomplete
            self.write_failures += 1
            log.error("capture of a call for %s failed: %s", exchange.key, err)
            try:
                await asyncio.to_thread(self.store.mark_incomplete, exchange.key)
            except Exception as marker:
                log.error("could not mark %s incomplete: %s", exchange.key, marker)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"captured": self.captured, "write_failures": self.write_failures})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/_capture_proxy/stats", self.stats)
        app.router.add_route("*", "/{tail:.*}", self.handle)

        async def closing(_: web.Application) -> None:
            await self.close()

        app.on_cleanup.append(closing)
        return app


def serve(upstream: str, capture_dir: str, host: str, port: int, model_name: str) -> None:
    """Run the proxy until interrupted."""
    proxy = CaptureProxy(upstream, capture_dir, model_name)
    telemetry.setup("capture_proxy")  # with ROLLOUTS_OTEL_ENABLED: a span per model call
    print(
        f"capture proxy on http://{host}:{port} -> {upstream}, capturing into {proxy.store.url}",
        flush=True,
    )
    web.run_app(proxy.app(), host=host, port=port, print=None, access_log=None)
