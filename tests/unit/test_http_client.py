"""The aiohttp-backed `/run` client speaks httpx's exception vocabulary, against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import orjson
import pytest

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers, start_servers
from infra.embedded import free_port
from infra.http import AiohttpClient
from schemas.messages import CallPolicy
from workers.rollout.agent_call import CallOutcome, call_run

ROW = {
    "responses_create_params": {"input": "What is 1 + 1?"},
    "expected_answer": "2",
    "_ng_task_index": 0,
    "_ng_rollout_index": 0,
}
JSON = {"content-type": "application/json"}
HUGE_MB = 48


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    servers: RunningServers = start_servers(
        {"math_agent": "math_env"}, knobs=AgentKnobs(huge_reply_mb=HUGE_MB)
    )
    yield servers.urls["math_agent"]
    servers.stop()


class Reply(NamedTuple):
    status_code: int
    content: bytes
    headers: dict[str, str]


def post(url: str, row: dict[str, object]) -> Reply:
    async def go() -> Reply:
        client = AiohttpClient()
        try:
            async with client.stream("POST", url, content=orjson.dumps(row), headers=JSON) as r:
                body = b"".join([chunk async for chunk in r.aiter_bytes()])
                return Reply(r.status_code, body, dict(r.headers))
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_reply_carries_status_and_body(agent: str) -> None:
    reply = post(agent + "/run", ROW)
    assert reply.status_code == 200
    assert orjson.loads(reply.content)["expected_answer"] == "2"
    assert post(agent + "/run", {**ROW, "fault": "http500"}).status_code == 500


def test_a_dropped_connection_is_a_remote_protocol_error(agent: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        post(agent + "/run", {**ROW, "fault": "reset"})


def test_a_refused_connection_is_a_connect_error() -> None:
    with pytest.raises(httpx.ConnectError):
        post(f"http://127.0.0.1:{free_port()}/run", ROW)


def call(agent: str, row: dict[str, object], **policy: object) -> CallOutcome:
    """`call_run` over a fresh AiohttpClient, then a plain call over the same client."""

    async def go() -> CallOutcome:
        client = AiohttpClient()
        try:
            outcome = await call_run(
                client,
                agent,
                row,
                CallPolicy(retry_requests=False, **policy),  # type: ignore[arg-type]
            )
            after = await call_run(client, agent, ROW, CallPolicy())
            assert after.result is not None, "the client still works after a cut reply"
            return outcome
        finally:
            await client.aclose()

    return asyncio.run(go())


def redirected(agent: str) -> int:
    count: int = httpx.get(agent + "/stats").json()["redirected"]
    return count


@pytest.mark.parametrize("kind", ["redirect307", "redirect302"])
def test_a_redirect_is_handed_back_not_followed(agent: str, kind: str) -> None:
    reply = post(agent + "/run", {**ROW, "fault": kind})
    assert reply.status_code == int(kind[-3:])
    assert reply.headers["Location"] == agent + "/redirected"
    outcome = call(agent, {**ROW, "fault": kind})
    failure = outcome.final_failure
    assert failure is not None and failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_message"] == (
        f"/run returned HTTP {kind[-3:]} redirect to {agent}/redirected; redirects are not followed"
    )
    assert redirected(agent) == 0


@pytest.mark.parametrize("kind", ["huge", "gzip_bomb"])
def test_a_reply_past_the_limit_is_cut_counting_decompressed_bytes(agent: str, kind: str) -> None:
    outcome = call(agent, {**ROW, "fault": kind}, max_reply_bytes=1024 * 1024)
    failure = outcome.final_failure
    assert failure is not None and outcome.requests_sent == 1
    assert failure["_ng_failure_class"] == "agent_request_failed"
    assert failure["_ng_failure_type"] == "ReplyTooLarge"
    assert failure["_ng_failure_http_status"] == 200
    assert "max_reply_bytes=1048576" in failure["_ng_failure_message"]


def test_a_gzip_reply_under_the_limit_is_decompressed(agent: str) -> None:
    outcome = call(agent, {**ROW, "fault": "gzip_bomb"}, max_reply_bytes=HUGE_MB * 1024 * 1024)
    assert outcome.result is not None
    assert len(outcome.result["pad"]) == HUGE_MB * 1024 * 1024 - len('{"reward": 1.0, "pad": ""}')


def test_a_reply_that_stops_is_cut_by_the_read_idle_timeout(agent: str) -> None:
    outcome = call(agent, {**ROW, "fault": "stall"}, read_idle_timeout_s=0.2)
    failure = outcome.final_failure
    assert failure is not None
    assert failure["_ng_failure_type"] == "ReadIdleTimeout"
    assert failure["failure_kind"] == "transport_timeout"
