"""The capture proxy in front of the example model server, over real HTTP on loopback.

200 concurrent rollouts, each making streamed and non-streamed calls in both dialects: every
capture file holds exactly its rollout's calls, in NeMo Gym's line format
(docs/how-to/model-call-capture.md); unprefixed calls pass through uncaptured; a failed write leaves the incomplete
marker; the bytes a caller gets are the model server's.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web

from examples.model_server import ModelServer
from examples.servers import free_port
from infra.capture import CaptureStore
from infra.capture_proxy import CaptureProxy
from tests.helpers import serve_app
from tests.ops_helpers import cli, cli_background
from workers.capture.records import parse_capture

ROLLOUTS = 200
LINE_KEYS = [
    "model_call_id", "dialect", "model_ref", "started_at", "completed_at", "latency_ms",
    "latency_ttft_ms", "status_code", "error_category", "request", "response",
]  # fmt: skip


@asynccontextmanager
async def servers(capture_dir: str) -> AsyncIterator[tuple[str, str, CaptureProxy, ModelServer]]:
    model = ModelServer()
    model_runner, model_url = await serve_app(model.app())
    proxy = CaptureProxy(model_url, capture_dir)
    proxy_runner, proxy_url = await serve_app(proxy.app())
    try:
        yield model_url, proxy_url, proxy, model
    finally:
        await proxy_runner.cleanup()
        await model_runner.cleanup()


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def body(tag: str, stream: bool, chat: bool = False) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"What is 2+3? ({tag})"}]
    out: dict[str, Any] = {"model": "stand-in-1", "stream": stream}
    out["messages" if chat else "input"] = messages
    out["metadata"] = {"expected_answer": "5", "difficulty": "0.3", "rollout_index": "0"}
    return out


async def post(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], **headers: str
) -> tuple[int, bytes, str]:
    async with session.post(url, data=orjson.dumps(payload), headers=headers) as reply:
        return reply.status, await reply.read(), reply.content_type


CALLS = [  # (dialect path, streamed, chat body)
    ("/v1/responses", False, False),
    ("/v1/responses", True, False),
    ("/v1/chat/completions", False, True),
    ("/v1/chat/completions", True, True),
]


def test_200_concurrent_rollouts_each_capture_holds_exactly_its_calls(tmp_path: Path) -> None:
    capture_dir = str(tmp_path / "calls")

    async def scenario() -> None:
        async with servers(capture_dir) as (_, proxy_url, proxy, model):
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def rollout(n: int) -> None:
                    key = f"{n}-0" if n % 2 else f"{n}-1-a1"
                    for i, (path, stream, chat) in enumerate(CALLS):
                        url = f"{proxy_url}/ng-rollout/{key}{path}"
                        status, data, kind = await post(
                            session, url, body(f"{key}#{i}", stream, chat), **{"x-session-id": key}
                        )
                        assert status == 200
                        assert kind == ("text/event-stream" if stream else "application/json")
                        end = b"data: [DONE]" if chat else b"event: response.completed"
                        assert (end in data) == stream

                await asyncio.gather(*(rollout(n) for n in range(ROLLOUTS)))
            assert model.calls == ROLLOUTS * len(CALLS)
            assert proxy.captured == ROLLOUTS * len(CALLS) and proxy.write_failures == 0

    run(scenario)
    store = CaptureStore(capture_dir)
    files = sorted(p.name for p in Path(capture_dir).iterdir())
    assert len(files) == ROLLOUTS
    for n in range(ROLLOUTS):
        key = f"{n}-0" if n % 2 else f"{n}-1-a1"
        data, incomplete = store.read(key)
        assert not incomplete and data is not None
        lines = [orjson.loads(line) for line in data.splitlines()]
        assert [_tag(line["request"]) for line in lines] == [
            f"{key}#{i}" for i in range(len(CALLS))
        ]
        for line, (_path, stream, chat) in zip(lines, CALLS, strict=True):
            assert list(line)[: len(LINE_KEYS)] == LINE_KEYS
            assert line["dialect"] == ("chat" if chat else "responses")
            assert line["model_ref"] == {"type": "responses_api_models", "name": "policy_model"}
            assert line["status_code"] == 200 and line["error_category"] is None
            assert line["client_session_id"] == key
            assert ("response_raw" in line) == stream
            assert line["response"]["usage"]  # reassembled from the stream, too
        calls, gaps = parse_capture(data, incomplete)
        assert gaps == [] and [c["tokens_out"] is not None for c in calls] == [True] * len(CALLS)


def _no_ids(data: bytes) -> bytes:
    """Without the response id and creation second, which two calls of the same model differ in."""
    return re.sub(rb'"(id":"resp_[0-9a-f]+|created(_at)?":[0-9]+)"?', b"", data)


def _tag(request: dict[str, Any]) -> str:
    messages: list[dict[str, str]] = request.get("input") or request.get("messages") or []
    text = messages[0]["content"]
    return text.rsplit("(", 1)[1].rstrip(")")


def test_the_caller_gets_the_model_servers_bytes_and_unprefixed_calls_are_not_captured(
    tmp_path: Path,
) -> None:
    capture_dir = tmp_path / "calls"

    async def scenario() -> None:
        async with servers(str(capture_dir)) as (model_url, proxy_url, proxy, _):
            async with aiohttp.ClientSession() as session:
                direct = await post(
                    session, f"{model_url}/v1/chat/completions", body("x", True, True)
                )
                through = await post(
                    session, f"{proxy_url}/v1/chat/completions", body("x", True, True)
                )
                # A deterministic model: the same stream but for its fresh response id.
                assert _no_ids(through[1]) == _no_ids(direct[1])
                assert through[0] == direct[0] == 200 and b"[DONE]" in through[1]
                other = await post(session, f"{proxy_url}/ng-rollout/7-0/stats", {})
                assert other[0] == 405  # forwarded (the model server has GET /stats only)
                async with session.get(f"{proxy_url}/stats") as reply:
                    assert (await reply.json())["calls"] == 2
            assert proxy.captured == 0

    run(scenario)
    assert not capture_dir.exists() or list(capture_dir.iterdir()) == []


def test_a_failed_write_leaves_the_incomplete_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture_dir = str(tmp_path / "calls")

    async def scenario() -> None:
        async with servers(capture_dir) as (_, proxy_url, proxy, _model):
            real = proxy.store.append

            def append(key: str, line: bytes) -> None:
                if key == "1-0":
                    raise OSError("disk full")
                real(key, line)

            monkeypatch.setattr(proxy.store, "append", append)
            async with aiohttp.ClientSession() as session:
                for key in ("0-0", "1-0"):
                    url = f"{proxy_url}/ng-rollout/{key}/v1/responses"
                    assert (await post(session, url, body(key, False)))[0] == 200
            assert proxy.write_failures == 1

    run(scenario)
    store = CaptureStore(capture_dir)
    assert store.read("1-0") == (None, True)
    _, gaps = parse_capture(*store.read("1-0"))
    assert gaps == [{"code": "model_call_capture_incomplete"}]
    data, incomplete = store.read("0-0")
    assert data is not None and not incomplete


def test_an_upstream_error_and_an_unreachable_upstream_are_captured(tmp_path: Path) -> None:
    capture_dir = str(tmp_path / "calls")

    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", failing)
        runner, url = await serve_app(app)
        proxy = CaptureProxy(url, capture_dir)
        proxy_runner, proxy_url = await serve_app(proxy.app())
        try:
            async with aiohttp.ClientSession() as session:
                status, data, _ = await post(
                    session, f"{proxy_url}/ng-rollout/2-0/v1/responses", {}
                )
                assert status == 503 and orjson.loads(data)["error"]["message"] == "overloaded"
                proxy.upstream = f"http://127.0.0.1:{free_port()}"  # nothing listens there
                status, _, _ = await post(session, f"{proxy_url}/ng-rollout/3-0/v1/responses", {})
                assert status == 502
        finally:
            await proxy_runner.cleanup()
            await runner.cleanup()

    run(scenario)
    store = CaptureStore(capture_dir)
    failed = orjson.loads(store.read("2-0")[0] or b"")
    assert (failed["status_code"], failed["error_category"]) == (503, "upstream_error")
    assert failed["response"] == {"error": {"message": "overloaded"}}
    lost = orjson.loads(store.read("3-0")[0] or b"")
    assert (lost["status_code"], lost["error_category"], lost["response"]) == (
        None,
        "connection",
        None,
    )


def test_the_command_serves_as_a_user_runs_it(tmp_path: Path) -> None:
    """`rollouts capture-proxy` in its own process, in front of a model server in another."""
    bad = cli("capture-proxy", "--upstream", "model-host:8000", "--capture-dir", str(tmp_path))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --upstream must be an http(s) URL, got 'model-host:8000'"
    ]
    model_port, proxy_port = free_port(), free_port()
    model = subprocess.Popen(
        [sys.executable, "-m", "examples.model_server", "--port", str(model_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proxy = cli_background(
        "capture-proxy", "--upstream", f"http://127.0.0.1:{model_port}",
        "--capture-dir", str(tmp_path / "calls"), "--port", str(proxy_port),
        log=tmp_path / "proxy.log",
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{proxy_port}/ng-rollout/4-2-a1/v1/responses"
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = httpx.post(url, json=body("cli", False), timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
                time.sleep(0.2)
        assert reply.status_code == 200 and reply.json()["object"] == "response"
    finally:
        for proc in (proxy, model):
            proc.terminate()
            proc.wait(10)
    lines = (tmp_path / "calls" / "4-2-a1.capture.jsonl").read_bytes().splitlines()
    assert len(lines) == 1 and orjson.loads(lines[0])["status_code"] == 200
    assert "capture proxy on http://127.0.0.1:" in (tmp_path / "proxy.log").read_text()
