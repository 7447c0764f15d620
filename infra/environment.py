"""Settings that come from environment variables, read once per process, and the cluster's URLs.

`from_env()` reads the variables the first time it is called (never at import) and returns the
same frozen `Environment` ever after: a worker started by `celery -A workers.app worker`,
`rollouts worker` or a local cluster learns its cluster, lease and lock expiries and pool size
from it, and the producer falls back on it for the broker and Redis no flag named.

`resolve_cluster` is the one place a command decides its broker and Redis URLs: flags, then the
environment; `operated_redis_url` adds the shard's manifest for the commands that operate a
recorded shard (`status`, `cancel`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
HEALTH_RANGE_BYTES = 64 << 20
LIVE_KEY_TTL_S = 7 * 24 * 3600


def redis_url(url: object) -> str | None:
    """`url` when it is a Redis URL (`REDIS_SCHEMES`), else None (unset, or another broker)."""
    return url if isinstance(url, str) and url.startswith(REDIS_SCHEMES) else None


@dataclass(frozen=True)
class Environment:
    """The process's settings from `ROLLOUTS_*` variables (docs/reference/environment.md)."""

    broker_url: str | None = None
    """`ROLLOUTS_BROKER_URL`: the cluster's Celery broker."""
    redis_url: str | None = None
    """`ROLLOUTS_REDIS_URL`: the Redis of locks, landed sets and chord results (else the broker)."""
    celery_broker_url: str | None = None
    """`CELERY_BROKER_URL`: Celery's own `-b URL`, which wins over `broker_url` in a worker."""
    lock_ttl_s: float = 30.0
    """`ROLLOUTS_LOCK_TTL_S`: the shard lock's expiry, how long a killed holder blocks the shard."""
    lease_ttl_s: float = 30.0
    """`ROLLOUTS_LEASE_TTL_S`: an admission slot's lease, how long a dead worker's slot stays taken."""
    visibility_timeout_s: int = 4 * 3600
    """`ROLLOUTS_VISIBILITY_TIMEOUT_S`: how long the broker waits before redelivering an unacked task."""
    worker_concurrency: int = 256
    """`ROLLOUTS_WORKER_CONCURRENCY`: a worker process's pool of threads (`-c` overrides it)."""
    task_events: bool = False
    """`ROLLOUTS_TASK_EVENTS=1`: workers send task events (for Flower) from the start."""
    health_range_bytes: int = HEALTH_RANGE_BYTES
    """`ROLLOUTS_HEALTH_RANGE_BYTES`: bytes per job of a distributed health recheck."""
    redis_max_connections: int = 64
    """`ROLLOUTS_REDIS_MAX_CONNECTIONS`: a process's connections per Redis pool (its threads share
    them; one that finds them all busy waits)."""
    redis_idle_s: float = 60.0
    """`ROLLOUTS_REDIS_IDLE_S`: a pool unused this long closes its free connections."""
    live_key_ttl_s: int = LIVE_KEY_TTL_S
    """`ROLLOUTS_LIVE_KEY_TTL_S`: a running shard's Redis keys expire this long after they were
    last written or refreshed (by a worker's write, or its producer while it waits): the keys of
    a run nobody works on any more go by themselves."""
    gc_thresholds: tuple[int, int, int] | None = None
    """`ROLLOUTS_GC_THRESHOLDS`: a worker's garbage-collector thresholds, as `700,10,10`
    (CPython's own); None: the worker's (`workers/gc_tuning.py`)."""
    prefetch_ahead: int | None = None
    """`ROLLOUTS_PREFETCH_AHEAD`: deliveries a rollout worker holds beyond its `-c` slots while they
    are all busy; None: none (a slot given back while its rollout lands is refilled at once
    anyway: `workers/pool.py`'s `PrefetchAhead`)."""
    finish_read_ahead: bool = True
    """`ROLLOUTS_FINISH_READ_AHEAD`: `0` turns off reading ahead, the finish step's pass over a
    generation's results run by the worker that landed them first while they land
    (`workers/finish_ahead.py`); the finish task then reads them all once the last rollout
    settled."""


def read_environment(environ: Mapping[str, str]) -> Environment:
    """The settings in `environ`; an empty URL counts as unset, a malformed number raises ValueError."""
    return Environment(
        broker_url=environ.get("ROLLOUTS_BROKER_URL") or None,
        redis_url=environ.get("ROLLOUTS_REDIS_URL") or None,
        celery_broker_url=environ.get("CELERY_BROKER_URL") or None,
        lock_ttl_s=float(environ.get("ROLLOUTS_LOCK_TTL_S", "30")),
        lease_ttl_s=float(environ.get("ROLLOUTS_LEASE_TTL_S", "30")),
        visibility_timeout_s=int(environ.get("ROLLOUTS_VISIBILITY_TIMEOUT_S", str(4 * 3600))),
        worker_concurrency=int(environ.get("ROLLOUTS_WORKER_CONCURRENCY", "256")),
        task_events=environ.get("ROLLOUTS_TASK_EVENTS", "0") == "1",
        health_range_bytes=int(environ.get("ROLLOUTS_HEALTH_RANGE_BYTES", HEALTH_RANGE_BYTES)),
        redis_max_connections=int(environ.get("ROLLOUTS_REDIS_MAX_CONNECTIONS", "64")),
        redis_idle_s=float(environ.get("ROLLOUTS_REDIS_IDLE_S", "60")),
        live_key_ttl_s=max(1, int(environ.get("ROLLOUTS_LIVE_KEY_TTL_S", LIVE_KEY_TTL_S))),
        gc_thresholds=parse_thresholds(environ.get("ROLLOUTS_GC_THRESHOLDS") or None),
        prefetch_ahead=_non_negative("ROLLOUTS_PREFETCH_AHEAD", environ),
        finish_read_ahead=environ.get("ROLLOUTS_FINISH_READ_AHEAD", "1") != "0",
    )


def _non_negative(name: str, environ: Mapping[str, str]) -> int | None:
    """An optional count: unset or empty is None; anything but a non-negative integer raises."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a non-negative integer")
    return int(text)


def parse_thresholds(text: str | None) -> tuple[int, int, int] | None:
    """`ROLLOUTS_GC_THRESHOLDS`: three non-negative integers, comma-separated; ValueError else."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"ROLLOUTS_GC_THRESHOLDS={text!r}: expected three integers, as 700,10,10")
    first, second, third = (int(p) for p in parts)
    return first, second, third


@functools.cache
def from_env() -> Environment:
    """This process's settings, read from `os.environ` on the first call."""
    return read_environment(os.environ)


@dataclass(frozen=True)
class Cluster:
    """Where a run coordinates: the Celery broker, and the Redis of locks, landed sets and results."""

    broker_url: str
    redis_url: str
    broker_from: str = field(default="--broker", compare=False)
    """Where the broker URL came from (`--broker`, `ROLLOUTS_BROKER_URL`, the manifest), for messages."""
    redis_from: str = field(default="--redis", compare=False)
    """Where the Redis URL came from (`--redis`, `ROLLOUTS_REDIS_URL`, the broker's flag, ...)."""


def resolve_cluster(broker_url: str | None = None, redis_url: str | None = None) -> Cluster | None:
    """`--broker`, else `ROLLOUTS_BROKER_URL`; its Redis: `--redis`, else `ROLLOUTS_REDIS_URL`,
    else the broker. None when no broker is named (the caller starts a local cluster or refuses).
    """
    env = from_env()
    broker, broker_from = (
        (broker_url, "--broker") if broker_url else (env.broker_url, "ROLLOUTS_BROKER_URL")
    )
    if not broker:
        return None
    if redis_url:
        return Cluster(broker, redis_url, broker_from, "--redis")
    if env.redis_url:
        return Cluster(broker, env.redis_url, broker_from, "ROLLOUTS_REDIS_URL")
    return Cluster(broker, broker, broker_from, broker_from)


def worker_cluster() -> Cluster:
    """The cluster a worker joins: `ROLLOUTS_BROKER_URL`, else the local Redis; its Redis:
    `ROLLOUTS_REDIS_URL`, else the broker when it is a Redis, else the local Redis."""
    env = from_env()
    broker = env.broker_url or LOCAL_REDIS_URL
    redis_url = env.redis_url or (broker if broker.startswith(REDIS_SCHEMES) else LOCAL_REDIS_URL)
    return Cluster(broker, redis_url)


def operated_redis_url(
    redis_url: str | None, broker_url: str | None, recorded: str | None
) -> str | None:
    """The Redis of a recorded shard: `--redis`, `--broker`, `ROLLOUTS_REDIS_URL`,
    `ROLLOUTS_BROKER_URL`, else the one its manifest `recorded` (unless redacted); else None."""
    env = from_env()
    found = redis_url or broker_url or env.redis_url or env.broker_url
    if found:
        return found
    if recorded and "***" not in recorded:
        return recorded
    return None
