"""Environment-derived settings and the one resolution of a cluster's broker and Redis URLs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.environment import (
    LOCAL_REDIS_URL,
    Cluster,
    Environment,
    from_env,
    operated_redis_url,
    read_environment,
    resolve_cluster,
    worker_cluster,
)

VARIABLES = ("ROLLOUTS_BROKER_URL", "ROLLOUTS_REDIS_URL", "CELERY_BROKER_URL")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A clean slate of the URL variables; `from_env` re-reads them after the test set them."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    from_env.cache_clear()
    yield monkeypatch
    from_env.cache_clear()


def test_defaults_and_parsing() -> None:
    assert read_environment({}) == Environment()
    parsed = read_environment(
        {
            "ROLLOUTS_BROKER_URL": "",
            "ROLLOUTS_LOCK_TTL_S": "2.5",
            "ROLLOUTS_LEASE_TTL_S": "3",
            "ROLLOUTS_VISIBILITY_TIMEOUT_S": "60",
            "ROLLOUTS_WORKER_CONCURRENCY": "8",
            "ROLLOUTS_TASK_EVENTS": "1",
            "ROLLOUTS_HEALTH_RANGE_BYTES": "300",
            "ROLLOUTS_GC_THRESHOLDS": "700, 10,10",
        }
    )
    assert parsed == Environment(
        broker_url=None,
        lock_ttl_s=2.5,
        lease_ttl_s=3.0,
        visibility_timeout_s=60,
        worker_concurrency=8,
        task_events=True,
        health_range_bytes=300,
        gc_thresholds=(700, 10, 10),
    )
    with pytest.raises(ValueError):
        read_environment({"ROLLOUTS_LOCK_TTL_S": "soon"})
    for bad in ("700,10", "700,10,10,1", "700,-1,10", "a,b,c"):
        with pytest.raises(ValueError, match="ROLLOUTS_GC_THRESHOLDS"):
            read_environment({"ROLLOUTS_GC_THRESHOLDS": bad})


def test_read_once(env: pytest.MonkeyPatch) -> None:
    env.setenv("ROLLOUTS_BROKER_URL", "redis://a:1/0")
    first = from_env()
    env.setenv("ROLLOUTS_BROKER_URL", "redis://b:1/0")
    assert from_env() is first
    assert first.broker_url == "redis://a:1/0"


def test_flags_then_environment_then_the_broker(env: pytest.MonkeyPatch) -> None:
    assert resolve_cluster() is None
    assert resolve_cluster(redis_url="redis://r:1/0") is None
    assert resolve_cluster("redis://b:1/0") == Cluster("redis://b:1/0", "redis://b:1/0")
    env.setenv("ROLLOUTS_BROKER_URL", "redis://eb:1/0")
    env.setenv("ROLLOUTS_REDIS_URL", "redis://er:1/0")
    from_env.cache_clear()
    assert resolve_cluster() == Cluster("redis://eb:1/0", "redis://er:1/0")
    assert resolve_cluster("redis://b:1/0") == Cluster("redis://b:1/0", "redis://er:1/0")
    assert resolve_cluster(None, "redis://r:1/0") == Cluster("redis://eb:1/0", "redis://r:1/0")


def test_operated_shard_falls_back_on_the_recorded_redis(env: pytest.MonkeyPatch) -> None:
    assert operated_redis_url(None, None, "redis://rec:1/0") == "redis://rec:1/0"
    assert operated_redis_url(None, None, "redis://:***@rec:1/0") is None
    assert operated_redis_url(None, "redis://b:1/0", "redis://rec:1/0") == "redis://b:1/0"
    env.setenv("ROLLOUTS_BROKER_URL", "redis://eb:1/0")
    from_env.cache_clear()
    assert operated_redis_url(None, None, "redis://rec:1/0") == "redis://eb:1/0"
    assert operated_redis_url("redis://r:1/0", "redis://b:1/0", None) == "redis://r:1/0"


def test_a_worker_defaults_to_the_local_redis(env: pytest.MonkeyPatch) -> None:
    assert worker_cluster() == Cluster(LOCAL_REDIS_URL, LOCAL_REDIS_URL)
    env.setenv("ROLLOUTS_BROKER_URL", "amqp://mq:5672//")
    from_env.cache_clear()
    assert worker_cluster() == Cluster("amqp://mq:5672//", LOCAL_REDIS_URL)
    env.setenv("ROLLOUTS_REDIS_URL", "redis://r:1/0")
    from_env.cache_clear()
    assert worker_cluster() == Cluster("amqp://mq:5672//", "redis://r:1/0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", None), (" 0 ", 0), ("512", 512), ("-1", ValueError), ("x", ValueError)],
)
def test_prefetch_ahead_is_a_non_negative_count(text: str, expected: int | type | None) -> None:
    environ = {"ROLLOUTS_PREFETCH_AHEAD": text}
    if expected is ValueError:
        with pytest.raises(ValueError, match="ROLLOUTS_PREFETCH_AHEAD"):
            read_environment(environ)
    else:
        assert read_environment(environ).prefetch_ahead == expected
