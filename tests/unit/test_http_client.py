"""The aiohttp-backed `/run` client speaks httpx's exception vocabulary, against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import orjson
import pytest

from examples.servers import RunningServers, start_servers
from infra.embedded import free_port
from infra.http import AiohttpClient

ROW = {
    "responses_create_params": {"input": "What is 1 + 1?"},
    "expected_answer": "2",
    "_ng_task_index": 0,
    "_ng_rollout_index": 0,
}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    servers: RunningServers = start_servers({"math_agent": "math_env"})
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
