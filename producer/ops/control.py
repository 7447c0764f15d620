"""Operating a running shard: finding its Redis, cancelling or draining it, starting Flower."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import redis

from infra import keys
from infra.environment import from_env, operated_redis_url
from infra.redis_client import client
from infra.runs import read_manifest
from infra.store import RunDir
from producer.shard.local_cluster import attached_url
from schemas.config import REDACTED
from schemas.errors import StorageError, UsageError
from schemas.records import Manifest


def load_manifest(rd: RunDir, shard: str) -> Manifest:
    try:
        return read_manifest(rd, shard)
    except StorageError as exc:
        raise UsageError(str(exc)) from None


def find_redis_url(
    rd: RunDir, manifest: Manifest, redis_url: str | None, broker_url: str | None
) -> str | None:
    """`--redis`, `--broker`, the environment, else the Redis the current generation recorded;
    for a local run, its cluster's while it runs (left for this user: `attach_path`)."""
    last = manifest.generations[-1] if manifest.generations else None
    found = operated_redis_url(redis_url, broker_url, last.redis_url if last else None)
    if found is None and last is not None and last.local:
        found = attached_url(rd.url, manifest.shard)
    return found


def unknown_redis(manifest: Manifest) -> str:
    """Why `find_redis_url` found no Redis for the shard, and what to pass."""
    recorded = manifest.generations[-1].redis_url if manifest.generations else None
    if recorded and REDACTED in recorded:
        return (
            f"the run's Redis is recorded with its password masked ({recorded}); "
            "pass --redis URL (or --broker URL)"
        )
    return "the run's Redis is unknown; pass --redis URL"


def cancel_shard(rd: RunDir, shard: str, redis_url: str | None, drain: bool) -> str:
    """Stop the shard: nothing new starts; without `drain` the running `/run` calls are cancelled too.

    Returns what was done, for the user.
    """
    manifest = load_manifest(rd, shard)
    if manifest.state != "running":
        return f"nothing to cancel: {rd.url} shard {shard} is {manifest.state}"
    if redis_url is None:
        raise UsageError(unknown_redis(manifest))
    sid = keys.shard_id(rd.url, shard)
    try:
        client(redis_url).set(
            keys.shard_cancel(sid), "drain" if drain else "cancel", ex=from_env().live_key_ttl_s
        )
    except redis.RedisError as exc:
        raise UsageError(f"cannot reach the run's Redis at {redis_url}: {exc}") from None
    if drain:
        return (
            f"draining {manifest.run_id} shard {shard}: no rollout starts any more; running ones "
            "finish and land. `rollouts resume` runs the rest later."
        )
    return (
        f"cancelling {manifest.run_id} shard {shard}: no rollout starts any more and running "
        "/run calls are closed. `rollouts resume` runs the rest later."
    )


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# Flower's own ways to authenticate its web pages (https://flower.readthedocs.io, auth).
_AUTH_OPTIONS = ("--basic-auth", "--basic_auth", "--auth")
_AUTH_ENV = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")


def flower_command(port: int, address: str, extra: list[str]) -> list[str]:
    """`celery flower` against our app; the broker comes from the environment, never argv (where
    `ps` shows it with its password)."""
    return [
        sys.executable, "-m", "celery", "-A", "workers.app", "flower",
        f"--port={port}", f"--address={address}", *extra,
    ]  # fmt: skip


def check_flower_exposure(address: str, extra: list[str], env: Mapping[str, str]) -> None:
    """Refuse to serve Flower beyond loopback without authentication: its pages and `/metrics`
    show every task's arguments to anyone who reaches them."""
    if address in LOOPBACK:
        return
    if any(a.split("=", 1)[0] in _AUTH_OPTIONS for a in extra) or any(
        env.get(k) for k in _AUTH_ENV
    ):
        return
    raise UsageError(
        f"--address {address}: Flower would serve its pages and /metrics unauthenticated beyond "
        "this host; set FLOWER_BASIC_AUTH=user:password (or pass --basic-auth / --auth), or "
        "listen on 127.0.0.1"
    )
