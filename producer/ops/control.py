"""Operating a running shard: finding its Redis, cancelling or draining it, starting Flower."""

from __future__ import annotations

import sys

import redis

from infra import keys
from infra.environment import operated_redis_url
from infra.redis_client import client
from infra.runs import read_manifest
from infra.store import RunDir
from schemas.errors import StorageError, UsageError
from schemas.records import Manifest


def load_manifest(rd: RunDir, shard: str) -> Manifest:
    try:
        return read_manifest(rd, shard)
    except StorageError as exc:
        raise UsageError(str(exc)) from None


def find_redis_url(manifest: Manifest, redis_url: str | None, broker_url: str | None) -> str | None:
    """`--redis`, `--broker`, the environment, else the Redis the current generation recorded."""
    recorded = manifest.generations[-1].redis_url if manifest.generations else None
    return operated_redis_url(redis_url, broker_url, recorded)


def cancel_shard(rd: RunDir, shard: str, redis_url: str, drain: bool) -> str:
    """Stop the shard: nothing new starts; without `drain` the running `/run` calls are cancelled too.

    Returns what was done, for the user.
    """
    manifest = load_manifest(rd, shard)
    if manifest.state != "running":
        return f"nothing to cancel: {rd.url} shard {shard} is {manifest.state}"
    sid = keys.shard_id(rd.url, shard)
    try:
        client(redis_url).set(keys.shard_cancel(sid), "drain" if drain else "cancel")
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


def flower_command(broker_url: str, port: int, address: str, extra: list[str]) -> list[str]:
    """`celery flower` against our app and broker."""
    return [
        sys.executable, "-m", "celery", "-A", "workers.app", "--broker", broker_url, "flower",
        f"--port={port}", f"--address={address}", *extra,
    ]  # fmt: skip
