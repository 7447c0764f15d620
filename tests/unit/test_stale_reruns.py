"""Stale rollouts re-run under the feed's current policy version (`stale_rollouts="rerun"`):
the decision (`schemas/feed.py`) and the engine's loop over in-memory fakes
(`workers/rollout/fakes.py`): the stale result set aside, the agent called again, the bound."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from infra.http import EventLoopThread
from schemas import fields as F
from schemas.feed import FeedMember, is_stale
from schemas.outcomes import Ended
from schemas.settings import CollectionSettings
from tests.engine_helpers import Harness, loop_thread
from workers.rollout.fakes import FakeFeeds

RERUN = FeedMember(name="f", group="0/3", size=2, timeout_s=60.0, max_lag=1, reruns=2)


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    yield from loop_thread("test-stale-reruns")


@pytest.fixture
def h(loop: EventLoopThread) -> Harness:
    return Harness(loop)


@pytest.mark.parametrize(
    ("version", "current", "lag", "stale"),
    [
        (3, 4, 1, False),  # one behind: within the lag
        (2, 4, 1, True),  # two behind
        (4, 4, 0, False),
        (3, 4, 0, True),
        (5, 4, 1, False),  # an agent ahead of the feed is not stale
        (None, 4, 1, False),  # no version recorded: nothing to judge
        (2, None, 1, False),  # the trainer never set one
        (2, 4, None, False),  # no lag: nothing is stale
    ],
)
def test_is_stale(version: int | None, current: int | None, lag: int | None, stale: bool) -> None:
    assert is_stale(version, current, lag) is stale


def test_a_member_is_rerun_only_when_stale_and_with_reruns_left() -> None:
    assert RERUN.rerun(2, 4, done=0) and RERUN.rerun(2, 4, done=1)
    assert not RERUN.rerun(2, 4, done=2)  # the bound: it lands as it is
    assert not RERUN.rerun(3, 4, done=0)
    marked = RERUN.model_copy(update={"reruns": 0})  # stale_rollouts="mark"
    assert not marked.rerun(0, 9, done=0)


def test_the_setting_reaches_each_task_and_needs_a_lag() -> None:
    rows = [{F.TASK_INDEX: 0, F.ROLLOUT_INDEX: r} for r in range(2)]
    rerun = CollectionSettings(feed="f", max_policy_lag=1, stale_rollouts="rerun")
    member = rerun.feed_plan("f", rows, "0").member(rows[0])
    assert member["max_lag"] == 1 and member["reruns"] == 2 == rerun.max_stale_reruns
    mark = CollectionSettings(feed="f", max_policy_lag=1)
    assert "reruns" not in mark.feed_plan("f", rows, "0").member(rows[0])
    with pytest.raises(ValidationError, match="needs feed and max_policy_lag"):
        CollectionSettings(feed="f", stale_rollouts="rerun")


def counting_agent(h: Harness, replies: list[tuple[int, dict[str, Any]]]) -> None:
    """The agent answers each call with the next of `replies` (the last one repeated)."""

    async def answer(request: httpx.Request) -> httpx.Response:
        status, body = replies.pop(0) if len(replies) > 1 else replies[0]
        return httpx.Response(status, content=orjson.dumps(body))

    h.handler = answer


def test_a_call_ended_stale_is_set_aside_and_run_again_under_the_current_version(
    h: Harness,
) -> None:
    # Read as it is admitted: version 0; when its call ends the trainer is at 3 (3 > 0 + 1).
    h.feeds = FakeFeeds(versions=[0, 0, 3])
    counting_agent(h, [(200, {"reward": 0.0}), (200, {"reward": 1.0})])
    out = h.run(feed=RERUN)
    assert out.ended is Ended.LANDED
    assert len(h.requests) == 2  # called again
    [landed] = h.shard.results
    assert landed["reward"] == 1.0 and landed[F.POLICY_VERSION] == 3
    assert landed[F.STALE_RERUNS] == 1
    [aside] = h.feeds.set_aside_rows  # the stale result, as it would have landed, kept apart
    assert aside["reward"] == 0.0 and aside[F.POLICY_VERSION] == 0
    assert aside[F.SET_ASIDE] == {"reason": "stale", "policy_version": 3}
    assert F.STARTED_AT in aside and F.EXECUTION in aside
    assert h.feeds.counts == {"reruns": 1}
    assert out.requests == 2 and h.slots_returned()


def test_reruns_are_bounded_then_the_stale_result_lands_as_it_is(h: Harness) -> None:
    h.feeds = FakeFeeds(versions=[0, 0, 3, 6, 9])  # the trainer outruns every re-run
    out = h.run(feed=RERUN)
    assert out.ended is Ended.LANDED and len(h.requests) == 3  # the call and 2 re-runs
    [landed] = h.shard.results
    assert landed[F.POLICY_VERSION] == 6 and landed[F.STALE_RERUNS] == 2  # stale: marked later
    assert len(h.feeds.set_aside_rows) == 2 and h.feeds.counts == {"reruns": 2}


def test_with_mark_or_a_fresh_call_nothing_is_run_again(h: Harness) -> None:
    h.feeds = FakeFeeds(versions=[0, 0, 5])
    h.run(feed=RERUN.model_copy(update={"reruns": 0}))
    h.feeds.versions = [5, 5, 6]  # one behind: fresh
    h.row[F.ROLLOUT_INDEX] = 0  # another rollout of the task
    h.run(feed=RERUN)
    assert len(h.requests) == 2 and not h.feeds.set_aside_rows
    assert [r[F.POLICY_VERSION] for r in h.shard.results] == [0, 5]
    assert all(F.STALE_RERUNS not in r for r in h.shard.results)


def test_an_agent_that_names_its_own_version_is_judged_by_it(h: Harness) -> None:
    h.feeds = FakeFeeds(versions=[0, 0, 5])
    counting_agent(h, [(200, {"reward": 1.0, F.POLICY_VERSION: 5})])
    h.run(feed=RERUN)
    assert len(h.requests) == 1 and h.shard.results[0][F.POLICY_VERSION] == 5


def test_a_rerun_that_fails_lands_its_failure_and_counts_the_stale_result_dropped(
    h: Harness,
) -> None:
    h.feeds = FakeFeeds(versions=[0, 0, 3])
    counting_agent(h, [(200, {"reward": 1.0}), (400, {"error": "bad"})])
    out = h.run(feed=RERUN, max_attempts=1)
    assert out.ended is Ended.FAILED and not h.shard.results
    assert h.shard.failures[-1][F.POLICY_VERSION] == 3
    assert h.feeds.counts == {"reruns": 1, "dropped": 1}


def test_a_call_that_falls_behind_while_it_runs_is_cut_and_run_again(h: Harness) -> None:
    # Admitted under 0; the watch's first read (after half a second) finds 5: the call, which
    # would take a minute, is cut and the agent called again under 5.
    h.feeds = FakeFeeds(versions=[0, 0, 5])
    calls: list[float] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        calls.append(0.0)
        if len(calls) == 1:
            await asyncio.sleep(60)
        return httpx.Response(200, content=orjson.dumps({"reward": 1.0}))

    h.handler = answer
    out = h.run(feed=RERUN)
    assert out.ended is Ended.LANDED and len(calls) == 2
    [landed] = h.shard.results
    assert landed[F.POLICY_VERSION] == 5 and landed[F.STALE_RERUNS] == 1
    assert not h.feeds.set_aside_rows  # nothing came back to set aside
    assert h.feeds.counts == {"reruns": 1} and h.slots_returned()


def test_a_stale_result_that_cannot_be_set_aside_lands_as_it_is(h: Harness) -> None:
    class Unwritable(FakeFeeds):
        def set_aside(self, feed: FeedMember, run: Any, row: dict[str, Any], rerun: int) -> str:
            raise OSError("the run directory is read-only")

    h.feeds = Unwritable(versions=[0, 0, 3])
    out = h.run(feed=RERUN)
    assert out.ended is Ended.LANDED and len(h.requests) == 1 and h.slots_returned()
    [landed] = h.shard.results
    assert landed[F.POLICY_VERSION] == 0 and F.STALE_RERUNS not in landed  # marked at handout
