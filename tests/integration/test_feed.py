"""The feed (docs/explanation/feed.md) against real `celery worker` processes, Redis and the
example agent: groups delivered whole, incomplete ones marked, never one that waits forever."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from examples.servers import RunningServers
from examples.tasks import make_row
from infra import keys
from producer import preprocess_examples, run_examples
from producer.api.feed import Feed, FeedGroup
from schemas import fields as F
from schemas.settings import CollectionSettings
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def planned(servers: RunningServers, tasks: int, repeats: int) -> list[dict[str, Any]]:
    raw = [make_row("arithmetic", i, "math_agent") for i in range(tasks)]
    return preprocess_examples(raw, servers.config(), CollectionSettings(num_repeats=repeats))


def by_task(groups: list[FeedGroup]) -> dict[int, FeedGroup]:
    return {int(g.group.split("/")[-1]): g for g in groups}


def test_a_group_with_a_failed_member_and_one_past_its_deadline_are_delivered_marked(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows = planned(servers, 3, 2)
    at = {F.rollout_key(row): row for row in rows}
    at[1, 1]["fault"] = {"kind": "http500", "times": 99}  # fails every attempt: a failure row
    at[2, 1]["agent_latency_ms"] = 120_000  # hangs past the group's deadline
    settings = {"feed": "t6", "group_timeout_s": 3.0, "max_attempts": 2}

    async def go() -> list[FeedGroup]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(tmp_path / "out"),
            route_failures_to_sidecar=True, retry_requests=False, settings=settings,
        )  # fmt: skip
        feed = Feed("t6", redis_url, block_s=0.2)
        got: list[FeedGroup] = []
        try:
            iter(completions)  # publishing starts
            next(completions)
            async for group in feed.groups(consumer="rank0", until_closed=False):
                got.append(group)
                assert await group.ack()
                if len(got) == 3:
                    break
        finally:
            await completions.aclose()
            await feed.aclose()
        return got

    got = by_task(asyncio.run(asyncio.wait_for(go(), 120)))
    assert sorted(got) == [0, 1, 2]
    assert got[0].reason == "complete" and not got[0].incomplete
    assert sorted(F.rollout_key(m) for m in got[0].members) == [(0, 0), (0, 1)]
    assert all("reward" in m for m in got[0].members)
    assert got[1].reason == "failed" and got[1].incomplete and len(got[1].members) == 2
    [failed] = got[1].item.failed
    assert F.rollout_key(failed) == (1, 1) and failed[F.FAILURE_CLASS]
    assert got[2].reason == "timeout" and got[2].incomplete
    assert [F.rollout_key(m) for m in got[2].members] == [(2, 0)]
    counts = r.hgetall(keys.feed_counts("t6"))
    assert counts[b"acked"] == b"3" and counts[b"members"] == b"5"
    assert r.xlen(keys.feed_stream("t6")) == 0  # acknowledged entries are deleted
