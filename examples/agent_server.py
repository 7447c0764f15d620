"""An example agent server: `POST /run` answers with the stand-in model and verifies the answer.

Knobs for tests and benchmarks (command-line flags, or `POST /admin/knobs` with the same names):
latency, a random fault rate over chosen fault kinds, a request log, and the stand-in model's
`sample_seed` and `wrong_rate` (another draw of its samples; a known fraction of its right
answers turned wrong). A row can also ask for
its own fault (`"fault": {"kind": "http500", "times": 1}`: its first request fails) or its own
latency (`"agent_latency_ms": 2000`). Fault kinds: http500, http502, http503, reset, malformed, list,
hang (no reply), stall (a reply that stops after its first bytes), huge (a valid JSON object of
`huge_reply_mb` MB, streamed), gzip_bomb (the same object gzip-compressed, sent with
`Content-Encoding: gzip`), redirect307 and redirect302 (to `/redirected`, which counts the
requests that followed it and answers with a valid result).
A row's `"result_extra": {...}` is merged into its result (e.g. an agent-chosen failure row with
`_ng_failure_class`, or `_ng_no_persist`). `deep_reply_every` N makes the reply of every task
whose index is a multiple of N nested `deep_reply_depth` levels deep (valid JSON that a parser
with a higher depth limit than its encoder reads but cannot write again).

A model (`--model-url URL`, e.g. a capture proxy in front of `examples/model_server.py`): each
rollout calls `URL/ng-rollout/<rollout id>/v1/responses` (the capture key: the rollout id,
`-a<n>` for attempts after the first, as NeMo Gym's agents do) with `x-session-id` set to its
invocation id, streamed with `--model-stream`; `--model-calls N` (or a row's `model_calls`) makes
it N calls, each given the conversation so far (a multi-turn rollout); a row's
`model_call_faults` asks the model for a truncated or empty reply to chosen calls, and its
`hang_after_calls` stops the agent after that many calls. The result carries the last call's
response (with the usage of all) and an `ng_agent_observations` bundle naming that invocation.
Without it, the stand-in answers in-process.

A rate limit (`--rate-limit-above K --retry-after S`): a call that would be the agent's
(K+1)-th concurrent one is answered at once with HTTP 429 and `Retry-After: S` (K = 0: every
call; S < 0: no header); the request log marks it `rate_limited` with its `retry_after`.

`GET /stats` reports requests, in-flight calls now and at most, cancelled calls (the client
closed the connection mid-call) and the 429s sent (`rate_limited`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import aiohttp
import orjson
from aiohttp import web

from examples.tasks import _unit, stand_in_answer, stand_in_response
from schemas import fields as F

FAULT_KINDS = (
    "http500",
    "http502",
    "http503",
    "reset",
    "malformed",
    "list",
    "hang",
    "stall",
    "huge",
    "gzip_bomb",
    "redirect307",
    "redirect302",
)
MB = 1024 * 1024
HUGE_HEAD = b'{"reward": 1.0, "pad": "'
HUGE_TAIL = b'"}'


@dataclass
class AgentKnobs:
    """Behaviour of the example agent."""

    latency_ms: float = 0.0
    latency_jitter_ms: float = 0.0
    fault_rate: float = 0.0
    fault_kinds: list[str] = field(default_factory=lambda: ["http500"])
    seed: int = 0
    request_log: str | None = None
    # Extra reasoning items in each response, about this many KB of JSON: long trajectories,
    # so that parsing and landing results is where a worker spends its CPU (bench `workers`).
    pad_kb: int = 0
    # Size of a `huge` or `gzip_bomb` reply in MB (decompressed).
    huge_reply_mb: int = 300
    # Every task whose `_ng_task_index` is a multiple of this (0: none) gets a reply nested
    # `deep_reply_depth` levels deep (the top-level object counts as one): a hostile reply.
    deep_reply_every: int = 0
    deep_reply_depth: int = 300
    # Answer 429 to a call above this many concurrent ones (None: never; 0: every call).
    rate_limit_above: int | None = None
    # The 429's Retry-After in seconds (negative: no header).
    retry_after_s: float = 1.0
    # Base URL of a Responses API model (None: the stand-in answers in-process).
    model_url: str | None = None
    # Ask the model for a streamed (SSE) response.
    model_stream: bool = False
    # Calls to the model per rollout (a row's `model_calls` overrides it).
    model_calls: int = 1
    # Another draw of the stand-in model's samples (0: the demo's), and the fraction of its right
    # answers turned wrong: two agents of known different accuracy (`rollouts compare`).
    sample_seed: int = 0
    wrong_rate: float = 0.0


def padding_items(kb: int) -> list[dict[str, Any]]:
    """Reasoning output items of about `kb` KB of JSON in all (each item about 1 KB)."""
    text = "step " * 180
    return [
        {"type": "reasoning", "id": f"rs_{i}", "summary": [{"type": "summary_text", "text": text}]}
        for i in range(kb)
    ]


@dataclass
class AgentStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: int = 0
    faults: int = 0
    completed: int = 0
    redirected: int = 0
    rate_limited: int = 0


class AgentServer:
    """State of one example agent instance."""

    def __init__(self, name: str, knobs: AgentKnobs | None = None) -> None:
        self.name = name
        self.knobs = knobs or AgentKnobs()
        self.stats = AgentStats()
        self._seen: dict[str, int] = {}
        self._log: IO[bytes] | None = None
        self._log_path: str | None = None
        self._pad: list[dict[str, Any]] | None = None
        self._bomb: tuple[int, bytes] | None = None
        self._session: aiohttp.ClientSession | None = None

    def _write_log(self, event: dict[str, Any]) -> None:
        path = self.knobs.request_log
        if not path:
            return
        if self._log is None or self._log_path != path:
            if self._log is not None:
                self._log.close()
            self._log = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open for the server's life
            self._log_path = path
        self._log.write(orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE))

    def _fault_for(self, row: dict[str, Any], key: str, attempt_no: int) -> str | None:
        wanted = row.get("fault")
        if isinstance(wanted, dict) and wanted.get("kind") in FAULT_KINDS:
            return str(wanted["kind"]) if attempt_no < int(wanted.get("times", 1)) else None
        if isinstance(wanted, str) and wanted in FAULT_KINDS:
            return wanted
        k = self.knobs
        if k.fault_rate > 0 and _unit(k.seed, key, attempt_no, "fault") < k.fault_rate:
            kinds = k.fault_kinds or ["http500"]
            return kinds[int(_unit(k.seed, key, attempt_no, "kind") * len(kinds))]
        return None

    async def run(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            row = orjson.loads(body)
        except orjson.JSONDecodeError:
            return web.Response(status=400, text="body is not JSON")
        if not isinstance(row, dict):
            return web.Response(status=422, text="body must be a JSON object")
        key = f"{row.get('_ng_run_id')}/{row.get('_ng_task_index')}-{row.get('_ng_rollout_index')}"
        attempt_no = self._seen.get(key, 0)
        self._seen[key] = attempt_no + 1
        st = self.stats
        st.requests += 1
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        started = time.time()
        event: dict[str, Any] = {
            "agent": self.name,
            "run": row.get("_ng_run_id"),
            "task": row.get("_ng_task_index"),
            "rollout": row.get("_ng_rollout_index"),
            "attempt": row.get("_ng_attempt_index", 0),
            "request_no": attempt_no,
            "start": started,
            "traceparent": request.headers.get("traceparent"),
        }
        self._write_log({**event, "event": "start"})
        outcome = "ok"
        try:
            limit = self.knobs.rate_limit_above
            if limit is not None and st.in_flight > limit:
                return self._rate_limited(event)
            fault = self._fault_for(row, key, attempt_no)
            delay = float(row.get("agent_latency_ms", self.knobs.latency_ms))
            if self.knobs.latency_jitter_ms:
                delay += self.knobs.latency_jitter_ms * (2 * _unit(key, attempt_no, "jit") - 1)
            if fault == "hang":
                outcome = "fault:hang"
                await asyncio.sleep(10**6)
            if delay > 0:
                await asyncio.sleep(delay / 1000)
            if fault is not None:
                st.faults += 1
                outcome = f"fault:{fault}"
                return await self._fault_response(request, fault)
            if self.knobs.model_url:
                traceparent = request.headers.get("traceparent")
                result = await self.model_result(row, self.knobs.model_url, traceparent)
                body = orjson.dumps(result)
            else:
                body = self.reply_body(row)
            st.completed += 1
            return web.Response(body=body, content_type="application/json")
        except asyncio.CancelledError:
            st.cancelled += 1
            outcome = "cancelled"
            raise
        finally:
            st.in_flight -= 1
            outcome = event.pop("outcome", outcome)
            self._write_log({**event, "event": "end", "end": time.time(), "outcome": outcome})

    def _rate_limited(self, event: dict[str, Any]) -> web.Response:
        """A 429 with the knobs' Retry-After; the log's end event says so."""
        self.stats.rate_limited += 1
        wait = self.knobs.retry_after_s
        event["outcome"] = "rate_limited"
        headers = {}
        if wait >= 0:
            event["retry_after"] = wait
            headers["Retry-After"] = f"{wait:g}"
        return web.Response(status=429, headers=headers, text="rate limited: slow down")

    async def _fault_response(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault == "http500":
            return web.Response(status=500, text="injected fault: internal error")
        if fault == "http502":
            return web.Response(status=502, text="injected fault: bad gateway")
        if fault == "http503":
            return web.Response(status=503, text="injected fault: unavailable")
        if fault == "malformed":
            return web.Response(
                body=b'{"reward": 1.0, "response": ', content_type="application/json"
            )
        if fault == "list":
            return web.Response(body=b"[1, 2, 3]", content_type="application/json")
        if fault in ("redirect307", "redirect302"):
            location = str(request.url.with_path("/redirected").with_query(None))
            return web.Response(
                status=int(fault[-3:]), headers={"Location": location}, text="moved"
            )
        if fault == "huge":
            return await self._huge(request)
        if fault == "gzip_bomb":
            # Compressed off the loop (zlib frees the GIL): ~1 s for 300 MB would stall every server.
            return web.Response(
                body=await asyncio.to_thread(self._gzip_bomb),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        if fault == "stall":
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"reward": ')
            await asyncio.sleep(10**6)
            return response
        # reset: drop the connection without an answer.
        if request.transport is not None:
            request.transport.close()
        raise ConnectionResetError("injected fault: connection reset")

    async def _huge(self, request: web.Request) -> web.StreamResponse:
        """A JSON object of `huge_reply_mb` MB, written 1 MB at a time (never held whole)."""
        size = max(self.knobs.huge_reply_mb * MB, len(HUGE_HEAD) + len(HUGE_TAIL))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = size
        await response.prepare(request)
        await response.write(HUGE_HEAD)
        block = memoryview(b"x" * MB)
        left = size - len(HUGE_HEAD) - len(HUGE_TAIL)
        while left > 0:
            n = min(left, MB)
            await response.write(block[:n])
            left -= n
        await response.write(HUGE_TAIL)
        await response.write_eof()
        return response

    def _gzip_bomb(self) -> bytes:
        """The `huge` object gzip-compressed (a thousandth of its size), made once per size."""
        mb = self.knobs.huge_reply_mb
        if self._bomb is None or self._bomb[0] != mb:
            gz = zlib.compressobj(9, zlib.DEFLATED, 31)
            block = b"x" * MB
            parts = [gz.compress(HUGE_HEAD)]
            left = max(mb * MB - len(HUGE_HEAD) - len(HUGE_TAIL), 0)
            while left > 0:
                parts.append(gz.compress(block[: min(left, MB)]))
                left -= MB
            parts += [gz.compress(HUGE_TAIL), gz.flush()]
            self._bomb = (mb, b"".join(parts))
        return self._bomb[1]

    async def redirected(self, request: web.Request) -> web.Response:
        """Where the redirect faults point: a client that followed one is counted here."""
        self.stats.redirected += 1
        return web.json_response({"reward": 1.0, "redirected": True, "method": request.method})

    def reply_body(self, row: dict[str, Any]) -> bytes:
        """The encoded result; a deep one for the tasks `deep_reply_every` picks."""
        body = orjson.dumps(self.result(row))
        every, task = self.knobs.deep_reply_every, row.get("_ng_task_index")
        if every > 0 and isinstance(task, int) and task % every == 0:
            # Written by hand: orjson (like the collector) refuses to encode past 254 levels.
            levels = max(self.knobs.deep_reply_depth - 1, 1)
            body = body[:-1] + b',"nested":' + b"[" * levels + b"]" * levels + b"}"
        return body

    def _padding(self) -> list[dict[str, Any]]:
        kb = self.knobs.pad_kb
        if kb <= 0:
            return []
        if self._pad is None or len(self._pad) != kb:
            self._pad = padding_items(kb)
        return self._pad

    async def model_result(
        self,
        row: dict[str, Any],
        model_url: str,
        traceparent: str | None = None,
        key: str | None = None,
    ) -> dict[str, Any]:
        """The result of the rollout's calls to the model, under its capture key (`key`, else the
        row's rollout id) and in the rollout's trace (the `traceparent` of its `/run` is passed on,
        as NeMo Gym's relay does).

        A row's `model_calls` (else the knob) is how many calls it makes, each given the
        conversation so far; `model_call_faults` ({"<i>": "truncated" | "empty" |
        "truncated_empty"}) asks the model for a faulty reply to call i (0-based), and
        `hang_after_calls` k makes the agent stop answering after k calls (the rollout is cut by
        its time limit). The result's response is the last call's, with the usage of all.
        """
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        key = key if key is not None else F.rollout_id(row)
        invocation = f"inv-{uuid.uuid4().hex[:12]}"
        params = dict(row.get("responses_create_params") or {})
        hints = {
            "expected_answer": str(row.get("expected_answer", "")),
            "difficulty": str(row.get("difficulty", 0.3)),
            "rollout_index": str(row.get("_ng_rollout_index", 0)),
        }
        items = params.get("input")
        asked = (
            [{"type": "message", "role": "user", "content": items}]
            if isinstance(items, str)
            else [
                {**i, "type": "message"} if isinstance(i, dict) and "type" not in i else i
                for i in items or []
            ]
        )
        calls = max(1, int(row.get("model_calls") or self.knobs.model_calls))
        faults = row.get("model_call_faults")
        faults = faults if isinstance(faults, dict) else {}
        hang_after = row.get("hang_after_calls")
        prefix = f"/ng-rollout/{key}" if key is not None else ""
        headers = {"content-type": "application/json", "x-session-id": invocation}
        if traceparent:
            headers["traceparent"] = traceparent
        url = f"{model_url.rstrip('/')}{prefix}/v1/responses"
        conversation: list[Any] = list(asked)
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        response: dict[str, Any] = {}
        for i in range(calls):
            if isinstance(hang_after, int) and i >= hang_after:
                await asyncio.sleep(10**6)  # cut by the rollout's time limit
            fault = faults.get(str(i))
            metadata = {**hints, **({"fault": str(fault)} if fault else {})}
            body = {
                **params,
                "input": conversation,
                "model": "stand-in-1",
                "metadata": metadata,
                "stream": self.knobs.model_stream,
            }
            async with self._session.post(url, data=orjson.dumps(body), headers=headers) as reply:
                reply.raise_for_status()
                raw = await reply.read()
            response = _streamed_response(raw) if self.knobs.model_stream else orjson.loads(raw)
            conversation += response.get("output") or []
            for name in usage:
                usage[name] += int((response.get("usage") or {}).get(name) or 0)
        if isinstance(hang_after, int) and hang_after >= calls:
            await asyncio.sleep(10**6)
        observations = {
            "source": "example_agent",
            "records": [
                {
                    "kind": "agent_invocation",
                    "invocation_id": invocation,
                    "status": "completed",
                    "conversation": conversation,
                }
            ],
        }
        final = {**response, "usage": usage} if calls > 1 else response
        return {**self.result(row, final), "ng_agent_observations": observations}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def result(self, row: dict[str, Any], model: dict[str, Any] | None = None) -> dict[str, Any]:
        if model is not None:
            return self._scored(row, model, _output_text(model))
        answer, out_tokens = stand_in_answer(row, self.knobs.sample_seed, self.knobs.wrong_rate)
        in_tokens = 12 + len(str(row.get("responses_create_params", ""))) // 8
        rid = f"{row.get('_ng_task_index')}-{row.get('_ng_rollout_index')}"
        response = stand_in_response(rid, answer, (in_tokens, out_tokens), before=self._padding())
        return self._scored(row, response, answer)

    def _scored(self, row: dict[str, Any], response: dict[str, Any], answer: str) -> dict[str, Any]:
        correct = answer.strip() == str(row.get("expected_answer", "")).strip()
        extra = row.get("result_extra")
        return {
            **row,
            "response": response,
            "reward": 1.0 if correct else 0.0,
            "extracted_answer": answer,
            **(extra if isinstance(extra, dict) else {}),
        }

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**asdict(self.stats), "knobs": asdict(self.knobs)})

    async def set_knobs(self, request: web.Request) -> web.Response:
        changes = await request.json()
        for name, value in changes.items():
            if not hasattr(self.knobs, name):
                return web.Response(status=422, text=f"unknown knob {name!r}")
            setattr(self.knobs, name, value)
        return web.json_response(asdict(self.knobs))

    async def reset(self, request: web.Request) -> web.Response:
        self.stats = AgentStats()
        self._seen.clear()
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/run", self.run)
        app.router.add_route("*", "/redirected", self.redirected)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_post("/admin/knobs", self.set_knobs)
        app.router.add_post("/admin/reset", self.reset)

        async def closing(_: web.Application) -> None:
            await self.aclose()

        app.on_cleanup.append(closing)
        return app

    def close(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if isinstance(item, dict) and item.get("type") == "message"
        for part in item.get("content") or []
        if isinstance(part, dict)
    )


def _streamed_response(raw: bytes) -> dict[str, Any]:
    """The final response of a Responses API event stream (its `response.completed` event)."""
    for block in reversed(raw.split(b"\n\n")):
        for line in block.splitlines():
            if line.startswith(b"data:"):
                event = orjson.loads(line[5:])
                if isinstance(event, dict) and isinstance(event.get("response"), dict):
                    response: dict[str, Any] = event["response"]
                    return response
    raise ValueError("the model's stream has no final response")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9101)
    parser.add_argument("--name", default="math_agent")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--latency-jitter-ms", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument(
        "--fault-kinds", default="http500", help=f"comma-separated: {', '.join(FAULT_KINDS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-log", default=None)
    parser.add_argument(
        "--huge-reply-mb", type=int, default=300, help="Size of a huge or gzip_bomb reply."
    )
    parser.add_argument("--deep-reply-every", type=int, default=0)
    parser.add_argument("--deep-reply-depth", type=int, default=300)
    parser.add_argument(
        "--rate-limit-above",
        type=int,
        default=None,
        help="Answer 429 to a call above this many concurrent ones (0: every call).",
    )
    parser.add_argument(
        "--retry-after", type=float, default=1.0, help="The 429's Retry-After in seconds."
    )
    parser.add_argument("--model-url", default=None, help="A Responses API model (or proxy).")
    parser.add_argument("--model-stream", action="store_true", help="Stream the model's replies.")
    parser.add_argument("--model-calls", type=int, default=1, help="Model calls per rollout.")
    a = parser.parse_args()
    knobs = AgentKnobs(
        latency_ms=a.latency_ms,
        latency_jitter_ms=a.latency_jitter_ms,
        fault_rate=a.fault_rate,
        fault_kinds=[k for k in a.fault_kinds.split(",") if k],
        seed=a.seed,
        request_log=a.request_log,
        huge_reply_mb=a.huge_reply_mb,
        deep_reply_every=a.deep_reply_every,
        deep_reply_depth=a.deep_reply_depth,
        rate_limit_above=a.rate_limit_above,
        retry_after_s=a.retry_after,
        model_url=a.model_url,
        model_stream=a.model_stream,
        model_calls=a.model_calls,
    )
    web.run_app(
        AgentServer(a.name, knobs).app(), host=a.host, port=a.port, handler_cancellation=True
    )


if __name__ == "__main__":
    main()
