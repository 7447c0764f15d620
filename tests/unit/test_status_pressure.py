"""`rollouts status`'s backpressure fields: read from the agent keys and the shard's counts."""

from __future__ import annotations

from typing import Any

import redis

from infra import keys
from producer.ops.pressure import add_backpressure, backpressure_line
from producer.shard.live import LiveSnapshot
from schemas.records import agent_urls

URL = "http://127.0.0.1:7/"
CONFIG: dict[str, Any] = {"agents": {"a": {"url": URL}, "b": {"url": "http://b"}, "bad": 3}}


def test_status_shows_each_agents_window_waiters_429s_and_waits(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    sec, usec = r.time()
    now = sec + usec / 1e6
    r.hset(keys.agent_window(URL), mapping={"window": 6.5, "ssthresh": 6.5, "cap": 64})
    r.zadd(keys.agent_waiting(URL), {"w1": now + 30, "w2": now + 30, "gone": now - 1})
    r.zadd(keys.agent_limited(URL), {"l1": now - 5, "l2": now - 30, "old": now - 90})
    snap = LiveSnapshot(
        now=now, shard_counts={"landed": 3, "rate_limit_waits:a": 4, "rate_limit_wait_ms:a": 5500}
    )
    report: dict[str, Any] = {"by_agent": {"a": {"planned": 9}, "b": {"planned": 1}}}
    add_backpressure(report, r, CONFIG, snap)
    r.close()
    assert report["by_agent"]["a"] == {
        "planned": 9,
        "window": 6.5,
        "window_cap": 64,
        "waiting_for_agent": 2,
        "rate_limited_last_minute": 2,
        "rate_limit_waits": 4,
        "rate_limit_waited_s": 5.5,
    }
    assert report["by_agent"]["b"]["window"] is None
    assert backpressure_line(report) == (
        "\nagent a: window 6.5/64 · waiting 2 · 429/503 in the last minute 2 · waits 4 (5.5s)"
    )


def test_agent_urls_skip_entries_without_one() -> None:
    assert agent_urls(CONFIG) == {"a": URL, "b": "http://b"}
    assert agent_urls({}) == {}
