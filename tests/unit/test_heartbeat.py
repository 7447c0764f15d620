"""The `/run` client's heartbeat: empty lines written on the connection after the request, until
the reply begins, never inside the request (issue 38)."""

from __future__ import annotations

import asyncio
import time

import pytest

from infra.http import AiohttpClient, heartbeat

MB = 1 << 20


async def serve_once(hold_s: float, read_delay_s: float, seen: dict[str, object]) -> int:
    """A server for one request: reads its head, waits `read_delay_s` before reading the body (the
    client's body write blocks meanwhile), then holds the reply `hold_s` while it records what
    else arrives; returns its port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ))  # fmt: skip
        await asyncio.sleep(read_delay_s)
        seen["body"] = await reader.readexactly(length)
        after = bytearray()
        deadline = time.monotonic() + hold_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                after += await asyncio.wait_for(reader.read(1024), left)
            except TimeoutError:
                break
        seen["after"] = bytes(after)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    seen["server"] = server
    port: int = server.sockets[0].getsockname()[1]
    return port


def exchange(
    body: bytes, every_s: float | None, hold_s: float, read_delay_s: float = 0.0
) -> dict[str, object]:
    seen: dict[str, object] = {}

    async def go() -> None:
        port = await serve_once(hold_s, read_delay_s, seen)
        client = AiohttpClient()
        try:
            with heartbeat(every_s):
                async with client.stream(
                    "POST", f"http://127.0.0.1:{port}/run", content=body, headers={}
                ) as reply:
                    seen["status"] = reply.status_code
                    seen["reply"] = b"".join([c async for c in reply.aiter_bytes()])
        finally:
            await client.aclose()
            server = seen.pop("server")
            assert isinstance(server, asyncio.Server)
            server.close()

    asyncio.run(go())
    return seen


def test_empty_lines_follow_the_request_until_the_reply_begins() -> None:
    seen = exchange(b'{"x": 1}', every_s=0.2, hold_s=1.1)
    assert seen["status"] == 200 and seen["reply"] == b"{}"
    assert seen["body"] == b'{"x": 1}'
    after = seen["after"]
    assert isinstance(after, bytes) and set(after.split(b"\r\n")) == {b""}
    assert 3 <= after.count(b"\r\n") <= 6  # one every 0.2 s of the 1.1 s wait


def test_no_heartbeat_writes_nothing() -> None:
    seen = exchange(b'{"x": 1}', every_s=None, hold_s=0.6)
    assert seen["after"] == b"" and seen["status"] == 200


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Sending a large body directly:ResourceWarning")
def test_a_body_still_being_sent_is_never_interrupted() -> None:
    # 16 MB outgrow the sockets' buffers: the body is still being written while beats fall due.
    body = b'{"pad": "' + b"x" * (16 * MB) + b'"}'
    seen = exchange(body, every_s=0.05, hold_s=0.5, read_delay_s=1.0)
    assert seen["body"] == body
    after = seen["after"]
    assert isinstance(after, bytes) and after and set(after.split(b"\r\n")) == {b""}
