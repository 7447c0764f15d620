"""`AgentCaller.call`: a call cut by the run's stop or by falling behind, in the rollout's own task.

The cut cancels the task that awaits the call; what the task does next must not see that
cancel again, and a cancel from outside must still end the task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from schemas.messages import CallPolicy
from workers.rollout.context import STALE, AgentCaller, Blocking, StopWatch

ROW = {"responses_create_params": {"input": "hi"}, "_ng_task_index": 0, "_ng_rollout_index": 0}
POLICY = CallPolicy(max_attempts=1)


def caller(reply_after_s: float, stop: list[str | None]) -> tuple[AgentCaller, list[bool]]:
    """A caller whose agent answers after `reply_after_s`, and the run's stop flag `stop[0]`;
    the list it returns records whether a call was cut before its reply (the agent saw it go)."""
    gone: list[bool] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        try:
            await asyncio.sleep(reply_after_s)
        except asyncio.CancelledError:
            gone.append(True)
            raise
        return httpx.Response(200, json={"reward": 1.0})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    stops = StopWatch(lambda sid: stop[0], Blocking(), 0.01)
    return AgentCaller(lambda: client, stops), gone


async def call_then_sleep(agent: AgentCaller, stale: asyncio.Future[int] | None = None) -> Any:
    """The call's result, then a sleep: a cancel left over from the cut would end the sleep."""
    result = await agent.call("http://agent", ROW, POLICY, "sid", stale)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.02)
    return result


def test_a_call_cut_by_the_run_s_stop_returns_the_reason_and_leaves_no_cancel() -> None:
    stop: list[str | None] = [None]
    agent, gone = caller(30, stop)

    async def go() -> Any:
        asyncio.get_running_loop().call_later(0.05, stop.__setitem__, 0, "cancel")
        return await asyncio.wait_for(call_then_sleep(agent), 5)

    outcome, reason = asyncio.run(go())
    assert outcome is None and reason == "cancel" and gone == [True]


def test_a_call_cut_for_falling_behind_returns_stale() -> None:
    agent, gone = caller(30, [None])

    async def go() -> Any:
        stale: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, stale.set_result, 3)
        return await asyncio.wait_for(call_then_sleep(agent, stale), 5)

    assert asyncio.run(go()) == (None, STALE) and gone == [True]


def test_a_call_that_ends_returns_its_outcome_and_a_later_stop_touches_nothing() -> None:
    stop: list[str | None] = [None]
    agent, gone = caller(0, stop)

    async def go() -> Any:
        got = await call_then_sleep(agent)
        stop[0] = "failed: x"  # the stop poller is gone with its last waiter: nothing fires
        await asyncio.sleep(0.05)
        return got

    outcome, reason = asyncio.run(go())
    assert outcome is not None and outcome.result is not None and reason is None
    assert outcome.result["reward"] == 1.0 and gone == []


def test_a_cancel_from_outside_ends_the_call_and_the_task() -> None:
    agent, gone = caller(30, [None])

    async def go() -> None:
        task = asyncio.create_task(call_then_sleep(agent))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(go())
    assert gone == [True]


def test_a_cut_that_comes_as_the_reply_ends_leaves_the_task_alone() -> None:
    """The watch resolves in the same turn of the loop as the reply: its callback runs after the
    call returned, and must not cancel what the task awaits next."""

    async def go() -> Any:
        stale: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handler(request: httpx.Request) -> httpx.Response:
            stale.set_result(3)  # its callbacks are queued now, to run after this step
            return httpx.Response(200, json={"reward": 1.0})

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        agent = AgentCaller(lambda: client, StopWatch(lambda sid: None, Blocking(), 0.01))
        return await asyncio.wait_for(call_then_sleep(agent, stale), 5)

    outcome, reason = asyncio.run(go())
    assert (outcome is None and reason == STALE) or (outcome.result["reward"] == 1.0)
