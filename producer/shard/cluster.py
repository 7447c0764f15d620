"""Which cluster a command runs a shard on, checked before anything is written.

`named_cluster` is the cluster the flags or the environment name (`rollouts run`); a command
that operates a recorded shard (`rollouts resume`) falls back, with `recorded_cluster`, on the
broker and Redis its manifest's latest generation recorded. Either is checked with
`infra.reachability.check_cluster` (exit 2, one line, before a byte is written). None means a
local cluster: nothing named, or a shard whose run was local.
"""

from __future__ import annotations

from infra.environment import Cluster, resolve_cluster
from infra.reachability import check_cluster
from schemas.config import REDACTED
from schemas.errors import UsageError
from schemas.records import Manifest

RECORDED_BROKER = "the manifest's broker"
RECORDED_REDIS = "the manifest's Redis"


def named_cluster(broker_url: str | None, redis_url: str | None) -> Cluster | None:
    """`--broker`/`--redis` or the environment's cluster, checked; None when nothing names one."""
    cluster = resolve_cluster(broker_url, redis_url)
    if cluster is not None:
        check_cluster(cluster)
    return cluster


def recorded_cluster(
    manifest: Manifest, broker_url: str | None, redis_url: str | None
) -> Cluster | None:
    """The named cluster, else the one the shard's latest generation ran on (checked); None for a
    run that was local (or recorded no broker: one written before generations named it)."""
    named = named_cluster(broker_url, redis_url)
    if named is not None or not manifest.generations:
        return named
    last = manifest.generations[-1]
    if last.local or last.broker_url is None or last.redis_url is None:
        return None
    if REDACTED in last.broker_url or REDACTED in last.redis_url:
        raise UsageError(
            f"the run's cluster is recorded with its password masked (broker {last.broker_url}, "
            f"Redis {last.redis_url}); pass --broker URL (and --redis URL) to use it"
        )
    cluster = Cluster(last.broker_url, last.redis_url, RECORDED_BROKER, RECORDED_REDIS)
    check_cluster(cluster)
    return cluster
