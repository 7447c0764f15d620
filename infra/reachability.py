"""Checking, before a command writes anything, that a cluster's broker and Redis answer.

`check_cluster` connects to the Redis of locks and results (and to the broker, when it is not
that Redis) with a short timeout and turns whatever goes wrong (nothing listening, a refused
password, a URL that is no Redis URL) into one `UsageError` naming the flag or variable the
address came from and the address, its password masked.
"""

from __future__ import annotations

import redis
from kombu.connection import Connection

from infra.environment import REDIS_SCHEMES, Cluster
from schemas.config import redact_url
from schemas.errors import UsageError

CONNECT_TIMEOUT_S = 5.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def check_redis(url: str, source: str) -> None:
    """Raise UsageError unless the Redis at `url` answers PING (and accepts its credentials)."""
    shown = redact_url(url)
    if not url.startswith(REDIS_SCHEMES):
        raise UsageError(f"{source} {shown}: not a Redis URL (redis://, rediss:// or unix://)")
    try:
        r = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S
        )
        try:
            r.ping()
        finally:
            r.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise UsageError(f"{source} {shown}: cannot use this Redis: {_first_line(exc)}") from None


def check_broker(url: str, source: str) -> None:
    """Raise UsageError unless the (non-Redis) broker at `url` accepts a connection."""
    try:
        with Connection(url, connect_timeout=CONNECT_TIMEOUT_S) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1, timeout=CONNECT_TIMEOUT_S)
    except Exception as exc:  # kombu and amqp raise their own trees, and OSError
        raise UsageError(
            f"{source} {redact_url(url)}: cannot reach this broker: {_first_line(exc)}"
        ) from None


def check_cluster(cluster: Cluster) -> None:
    """The broker and the Redis answer, else one UsageError (exit 2) saying which and where."""
    if (
        not cluster.redis_url.startswith(REDIS_SCHEMES)
        and cluster.redis_from == cluster.broker_from
    ):
        raise UsageError(
            f"{cluster.broker_from} {redact_url(cluster.broker_url)}: this broker is not a "
            "Redis, and a run needs one for its locks and results; pass --redis URL "
            "(or set ROLLOUTS_REDIS_URL)"
        )
    check_redis(cluster.redis_url, cluster.redis_from)
    if cluster.broker_url != cluster.redis_url:
        if cluster.broker_url.startswith(REDIS_SCHEMES):
            check_redis(cluster.broker_url, cluster.broker_from)
        else:
            check_broker(cluster.broker_url, cluster.broker_from)
