"""The Python API's caller under faults of its own: a reply of the wrong shape, a listener that
dies, a row that never gets an outcome (`result_timeout_s`). Real Redis, a real worker process
and the example agent."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.tasks import make_row
from infra import keys
from producer import RolloutFailedError, preprocess_examples, run_examples
from producer.api.replies import UNREADABLE
from producer.api.transport import Invocation
from schemas import fields as F
from tests.api_helpers import Got, consume, the_call
from tests.ops_helpers import ENV, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def rows_of(config: dict[str, Any], n: int, latency_ms: list[float]) -> list[dict[str, Any]]:
    rows = preprocess_examples([make_row("arithmetic", i, "math_agent") for i in range(n)], config)
    for row, ms in zip(rows, latency_ms, strict=True):
        row["agent_latency_ms"] = ms
    return rows


def call_config(make_run: MakeRun) -> dict[str, Any]:
    """The config of a call to the math agent alone, on one worker with short leases."""
    return make_run({"math_agent": "math_env"}, AgentKnobs(), env=ENV).servers.config()


@pytest.mark.timeout(120)
def test_a_reply_of_the_wrong_shape_fails_its_row_alone(
    make_run: MakeRun, redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    config = call_config(make_run)
    rows = rows_of(config, 6, [2000] * 6)
    got = Got()

    async def go() -> None:
        completions = run_examples(rows, config, broker_url=redis_url)
        try:
            consumer = asyncio.ensure_future(consume(completions, got, rows))
            await asyncio.to_thread(wait_for, lambda: bool(list(r.scan_iter(
                match=keys.api_call("*")))), 10, "the call")  # fmt: skip
            replies = keys.api_replies(the_call(r))
            # Before the real replies (the agent takes 2 s): one of another shape for row 2,
            # one that names no row, and one that is not JSON.
            r.rpush(replies, orjson.dumps({"index": 2, "outcome": {"ended": "exploded"}}))
            r.rpush(replies, b'{"outcome": null}', b"\xff not json")
            await consumer
        finally:
            await completions.aclose()

    with caplog.at_level(logging.ERROR, logger="producer.api.transport"):
        asyncio.run(asyncio.wait_for(go(), 60))
    outcomes = dict(zip(got.keys, got.values, strict=True))
    assert len(got.values) == 6
    failed = outcomes.pop((2, 0))
    assert isinstance(failed, RolloutFailedError) and failed.failure is not None
    assert failed.failure[F.FAILURE_CLASS] == UNREADABLE
    assert "outcome.ended" in str(failed)
    assert sorted(outcomes) == [(i, 0) for i in (0, 1, 3, 4, 5)]
    assert all(isinstance(v, dict) and "reward" in v for v in outcomes.values())
    logged = [m for m in caplog.messages if "could not be read" in m]
    assert len(logged) == 1 and "rollout 2-0 (row 2)" in logged[0]
    assert sum("names no row of the call" in m for m in caplog.messages) == 2


@pytest.mark.timeout(120)
def test_a_listener_that_dies_resolves_every_waiting_row_at_once_with_the_cause(
    make_run: MakeRun, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = call_config(make_run)
    pops = 0
    pop = Invocation._pop

    def failing_pop(self: Invocation, key: str) -> list[Any]:
        nonlocal pops
        pops += 1
        if pops == 4:
            raise RuntimeError("injected: the listener's bug")
        return pop(self, key)

    monkeypatch.setattr(Invocation, "_pop", failing_pop)
    rows = rows_of(config, 4, [8000] * 4)
    got = Got()

    async def go() -> float:
        completions = run_examples(rows, config, broker_url=redis_url, close_timeout_s=5)
        try:
            started = time.monotonic()
            await consume(completions, got, rows)
            return time.monotonic() - started
        finally:
            await completions.aclose()

    took = asyncio.run(asyncio.wait_for(go(), 60))
    assert took < 5, took  # at once, not after the rollouts' 8 s
    assert len(got.values) == 4
    for error in got.values:
        assert isinstance(error, RolloutFailedError) and "reply listener died" in str(error)
        assert isinstance(error.__cause__, RuntimeError)


@pytest.mark.timeout(120)
def test_a_row_without_an_outcome_in_time_raises_timeout_error_and_the_others_go_on(
    make_run: MakeRun, redis_url: str
) -> None:
    config = call_config(make_run)
    rows = rows_of(config, 4, [0, 500, 8000, 0])
    got = Got()

    async def go() -> None:
        completions = run_examples(
            rows, config, broker_url=redis_url, result_timeout_s=3, close_timeout_s=5
        )
        try:
            await consume(completions, got, rows)
        finally:
            await completions.aclose()

    asyncio.run(asyncio.wait_for(go(), 60))
    results = [v for v in got.values if isinstance(v, dict)]
    timeouts = [v for v in got.values if isinstance(v, TimeoutError)]
    assert len(results) == 3 and len(timeouts) == 1
    assert "rollout 2-0 has no outcome 3s after it was sent" in str(timeouts[0])
    assert got.values[-1] is timeouts[0]  # the last to resolve, the others unaffected
