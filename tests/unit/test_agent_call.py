"""The /run retry policy with httpx.MockTransport: what is retried, replayed, and how it is recorded."""

from __future__ import annotations

import asyncio
import gzip
import random
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from schemas.messages import CallPolicy
from workers.rollout.agent_call import BACKOFF_CAP_S, CallOutcome, backoff_s, call_run

ROW = {"_ng_task_index": 4, "_ng_rollout_index": 1, "agent_ref": {"name": "a"}, "x": 1}


def run(
    handler: Callable[[httpx.Request], httpx.Response], **policy: object
) -> tuple[CallOutcome, int]:
    calls = 0

    def counting(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return handler(request)

    async def go() -> CallOutcome:
        client = httpx.AsyncClient(transport=httpx.MockTransport(counting))
        try:
            return await call_run(
                client,
                "http://agent",
                dict(ROW),
                CallPolicy(backoff_base_s=0.001, **policy),  # type: ignore[arg-type]
            )
        finally:
            await client.aclose()

    return asyncio.run(go()), calls


def sequence(
    *responses: Callable[[httpx.Request], httpx.Response],
) -> Callable[[httpx.Request], httpx.Response]:
    it = iter(responses)
    return lambda request: next(it)(request)


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={**ROW, "_ng_task_index": 99, "reward": 1.0})


def status(code: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(code, text="x" * 3000)


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def reset(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("peer closed", request=request)


def test_result_keeps_the_planned_identity() -> None:
    outcome, calls = run(ok)
    assert calls == 1 and outcome.failures == []
    assert outcome.result is not None and outcome.result["_ng_task_index"] == 4


def test_500_is_agent_run_error_not_replayed_with_a_bounded_body() -> None:
    outcome, calls = run(status(500))
    assert calls == 1
    assert outcome.final_failure is not None
    assert outcome.final_failure["_ng_failure_class"] == "agent_run_error"
    assert len(outcome.final_failure["_ng_failure_response_body"]) == 2000
    assert outcome.final_failure["_ng_failure_response_body"].endswith("…")


# 429 and 503 are backpressure since issue 16: test_rate_limit_replies_end_the_call_for_the_engine.
@pytest.mark.parametrize("code", [502, 504])
def test_gateway_statuses_are_replayed_with_attempt_indexes(code: int) -> None:
    outcome, calls = run(sequence(status(code), status(code), ok))
    assert calls == 3
    assert [f.get("_ng_attempt_index", 0) for f in outcome.failures] == [0, 1]
    assert {f["_ng_failure_class"] for f in outcome.failures} == {"agent_request_failed"}
    assert outcome.result is not None and outcome.result["_ng_attempt_index"] == 2


@pytest.mark.parametrize("code", [429, 503])
def test_rate_limit_replies_end_the_call_for_the_engine(code: int) -> None:
    def limited(request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, headers={"Retry-After": "7"}, text="slow down")

    outcome, calls = run(sequence(status(502), limited))
    assert calls == 2 and outcome.requests_sent == 2
    assert outcome.final_failure is None and outcome.result is None
    limit = outcome.rate_limited
    assert limit is not None
    assert (limit.status, limit.retry_after_s, limit.attempt) == (code, 7.0, 1)
    assert limit.failure["_ng_failure_http_status"] == code
    assert limit.failure["_ng_attempt_index"] == 1
    # The 502 before it was a failed attempt; the rate limit is none.
    assert [f["_ng_failure_http_status"] for f in outcome.failures] == [502]


def test_replays_stop_at_the_attempt_limit_counting_earlier_attempts() -> None:
    _, calls = run(reset, max_attempts=3, retry_requests=True)
    assert calls == 3
    row = {**ROW, "_ng_attempt_index": 2}

    async def go() -> CallOutcome:
        client = httpx.AsyncClient(transport=httpx.MockTransport(reset))
        try:
            return await call_run(client, "http://agent", row, CallPolicy(backoff_base_s=0.001))
        finally:
            await client.aclose()

    resumed = asyncio.run(go())
    assert resumed.failures == [] and resumed.final_failure is not None
    assert resumed.final_failure["_ng_attempt_index"] == 2
    assert resumed.final_failure["failure_kind"] == "transport_peer_drop"


def test_retry_requests_off_never_replays_but_still_retries_connecting() -> None:
    outcome, calls = run(reset, retry_requests=False)
    assert calls == 1 and outcome.final_failure is not None
    outcome, calls = run(sequence(refused, refused, ok), retry_requests=False)
    assert calls == 3 and outcome.result is not None and outcome.failures == []
    assert "_ng_attempt_index" not in outcome.result


def test_connect_retries_are_bounded() -> None:
    outcome, calls = run(refused, connect_retries=2)
    assert calls == 3
    assert outcome.requests_sent == 0
    assert outcome.final_failure is not None
    assert outcome.final_failure["failure_kind"] == "transport_unreachable"


def test_time_limit_is_a_timeout_failure_not_a_crash() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, json={})

    async def go() -> CallOutcome:
        client = httpx.AsyncClient(transport=httpx.MockTransport(slow))
        try:
            return await call_run(
                client, "http://agent", dict(ROW), CallPolicy(timeout_s=0.05, retry_requests=False)
            )
        finally:
            await client.aclose()

    outcome = asyncio.run(go())
    assert outcome.final_failure is not None
    assert outcome.final_failure["failure_kind"] == "agent_timeout"


def test_backoff_is_full_jitter_and_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = CallPolicy(backoff_base_s=0.5)
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    assert [backoff_s(policy, k) for k in range(8)] == [
        0.5,
        1,
        2,
        4,
        8,
        16,
        BACKOFF_CAP_S,
        BACKOFF_CAP_S,
    ]
    monkeypatch.setattr(random, "uniform", lambda low, high: low)
    assert backoff_s(policy, 5) == 0


class Chunks:
    """A streamed reply body: `count` chunks of `size` bytes, the pause before each after the first."""

    def __init__(self, count: int, size: int, pause_s: float = 0.0) -> None:
        self.count, self.size, self.pause_s = count, size, pause_s
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(self.count):
            if i and self.pause_s:
                await asyncio.sleep(self.pause_s)
            self.pulled += 1
            yield b"x" * self.size


def streamed(code: int, body: Chunks) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(code, content=body)


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_agent_run_error_naming_its_location_and_never_followed(code: int) -> None:
    def moved(request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, headers={"Location": "http://elsewhere/steal"}, text="moved")

    outcome, calls = run(moved)
    assert calls == 1 and outcome.result is None and outcome.failures == []
    failure = outcome.final_failure
    assert failure is not None
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["failure_kind"] == "agent_run_error"
    assert failure["_ng_failure_http_status"] == code
    assert failure["_ng_failure_message"] == (
        f"/run returned HTTP {code} redirect to http://elsewhere/steal; redirects are not followed"
    )


def test_a_redirect_without_location_says_so() -> None:
    outcome, _ = run(status(307))
    assert outcome.final_failure is not None
    assert "redirect with no Location" in outcome.final_failure["_ng_failure_message"]


def test_a_reply_at_the_size_limit_lands() -> None:
    def exact(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"pad": "' + b"x" * 989 + b'"}')

    outcome, _ = run(exact, max_reply_bytes=1000)
    assert outcome.result is not None and len(outcome.result["pad"]) == 989


def test_an_oversize_reply_is_cut_as_soon_as_it_passes_the_limit_and_not_replayed() -> None:
    body = Chunks(count=1000, size=100)
    outcome, calls = run(streamed(200, body), max_reply_bytes=1050)
    assert calls == 1 and outcome.result is None and outcome.failures == []
    assert body.pulled == 11
    failure = outcome.final_failure
    assert failure is not None
    assert failure["_ng_failure_class"] == "agent_request_failed"
    assert failure["_ng_failure_type"] == "ReplyTooLarge"
    assert failure["_ng_failure_http_status"] == 200
    assert "max_reply_bytes=1050" in failure["_ng_failure_message"]
    assert failure["_ng_failure_response_body"] == "x" * 1000


def test_a_gzip_reply_counts_its_decompressed_bytes() -> None:
    packed = gzip.compress(b'{"pad": "' + b"x" * 100_000 + b'"}')
    assert len(packed) < 1000

    def bomb(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=packed, headers={"Content-Encoding": "gzip"})

    outcome, _ = run(bomb, max_reply_bytes=10_000)
    assert outcome.final_failure is not None
    assert outcome.final_failure["_ng_failure_type"] == "ReplyTooLarge"


def test_an_error_status_reads_only_the_body_its_failure_row_keeps() -> None:
    body = Chunks(count=100_000, size=1000)
    outcome, calls = run(streamed(500, body), max_reply_bytes=10**9)
    assert calls == 1 and body.pulled < 20
    failure = outcome.final_failure
    assert failure is not None and failure["_ng_failure_class"] == "agent_run_error"
    assert len(failure["_ng_failure_response_body"]) == 2000


def test_a_silent_reply_body_is_a_replayable_timeout() -> None:
    def stalling(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=Chunks(count=2, size=10, pause_s=5))

    outcome, calls = run(stalling, read_idle_timeout_s=0.05, max_attempts=2)
    assert calls == 2 and len(outcome.failures) == 1 and outcome.final_failure is not None
    for failure in [*outcome.failures, outcome.final_failure]:
        assert failure["_ng_failure_class"] == "agent_request_failed"
        assert failure["_ng_failure_type"] == "ReadIdleTimeout"
        assert failure["failure_kind"] == "transport_timeout"
        assert "read_idle_timeout_s" in failure["_ng_failure_message"]
    _, calls = run(stalling, read_idle_timeout_s=0.05, retry_requests=False)
    assert calls == 1


def test_a_slow_but_steady_body_is_not_idle() -> None:
    def steady(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=Chunks(count=5, size=1, pause_s=0.03))

    outcome, _ = run(steady, read_idle_timeout_s=0.5)
    assert outcome.final_failure is not None
    assert outcome.final_failure["_ng_failure_type"] == "JSONDecodeError"
