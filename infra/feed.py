"""A feed's upkeep, for its producer and its readers: open it, deliver expired groups, close it,
count it (docs/explanation/feed.md). The consumer API is `producer/api/feed.py`; members enter a
feed where they land (`workers/feed/publish.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from infra import keys
from infra.environment import from_env
from infra.feed_scripts import FEED_EXPIRE_LUA, feed_keys
from schemas.records import FeedStatus

EXPIRE_BATCH = 100
"""At most this many groups delivered per call of the expiry script (it runs often)."""


def ensure_group(r: redis.Redis, name: str) -> None:
    """Make the feed's stream and consumer group, if missing (a reader may come first)."""
    try:
        r.xgroup_create(keys.feed_stream(name), keys.FEED_CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def open_feed(
    r: redis.Redis, name: str, run_dir: str, fresh: bool = False, max_lag: int | None = None,
    writer: str | None = None,
) -> None:  # fmt: skip
    """Make the feed's consumer group (if missing) and mark it open: a dispatch of the run in
    `run_dir` publishes on it (its readers log their acknowledgements there). `fresh`: a new run
    or call, whose feed starts empty unless another shard of the same run directory still
    writes to it (what an earlier run of the same name left is dropped; the policy version the
    trainer set stays). `max_lag`: the run's `max_policy_lag`, kept for the feed's readers
    (their default). `writer`: the shard (`keys.shard_id`) that publishes; the feed closes once
    every writer finished."""
    if fresh and not _shared(r, name, run_dir, writer):
        version = r.hget(keys.feed_counts(name), "policy_version")
        r.delete(*feed_keys(name))
        if version is not None:
            r.hset(keys.feed_counts(name), "policy_version", version)
    ensure_group(r, name)
    pipe = r.pipeline(transaction=True)
    if writer is not None:
        pipe.sadd(keys.feed_writers(name), writer)
        pipe.expire(keys.feed_writers(name), int(from_env().live_key_ttl_s))
    pipe.hdel(keys.feed_counts(name), "closed")
    pipe.hset(keys.feed_counts(name), "run_dir", run_dir)
    if max_lag is not None:
        pipe.hset(keys.feed_counts(name), "max_policy_lag", max_lag)
    pipe.expire(keys.feed_counts(name), int(from_env().live_key_ttl_s))
    pipe.expire(keys.feed_stream(name), int(from_env().live_key_ttl_s))
    pipe.execute()


def _shared(r: redis.Redis, name: str, run_dir: str, writer: str | None) -> bool:
    """Whether another shard of the run in `run_dir` writes to the feed (a shard that never
    finished in another run directory, or this shard's own earlier run, does not count)."""
    pipe = r.pipeline(transaction=True)
    pipe.smembers(keys.feed_writers(name))
    pipe.hget(keys.feed_counts(name), "run_dir")
    writers, stored = pipe.execute()
    others = {w.decode() for w in writers} - {writer}
    return bool(others) and stored is not None and stored.decode() == run_dir


def expire_groups(r: redis.Redis, name: str, reason: str = "timeout") -> int:
    """Deliver the feed's groups past their deadline (`reason="closed"`: every open group, then
    mark the feed closed); returns how many were delivered."""
    script = r.register_script(FEED_EXPIRE_LUA)
    total = 0
    while True:
        ttl = int(from_env().live_key_ttl_s)
        args: list[str | int] = [keys.feed_group_prefix(name), reason, EXPIRE_BATCH, ttl]
        n = int(script(keys=feed_keys(name), args=args))
        total += n
        if n < EXPIRE_BATCH:
            return total


def close_feed(r: redis.Redis, name: str, writer: str | None = None) -> int:
    """Shard `writer` is done: once no other shard writes to the feed, deliver every open group
    as it is (marked `closed`) and mark the feed closed, so its readers end once they
    acknowledged everything; returns the groups delivered (none while a writer is left)."""
    if writer is not None:
        r.srem(keys.feed_writers(name), writer)
    return expire_groups(r, name, "closed")


@dataclass(frozen=True)
class FeedCounts:
    """A feed's counts as Redis holds them."""

    members: int
    """Rollouts that entered the feed."""
    groups: int
    """Group items delivered to the stream."""
    acked: int
    """Group items acknowledged."""
    unacked: int
    """Group items in the stream not acknowledged: read and pending, or not read yet."""
    pending: int
    """Of those, read by a consumer and not acknowledged."""
    open: int
    """Groups with members landed, waiting for the rest."""
    closed: bool
    stale: int
    """Group items handed to a consumer as stale (`max_policy_lag`)."""
    reruns: int
    """Rollouts found stale as their call ended and run again (`stale_rollouts="rerun"`)."""
    dropped: int
    """Of those, set aside with no result to take their place: the re-run failed or was
    cancelled (the member settled with its failure row, or not at all)."""
    policy_version: int | None
    """The current policy version (`set_policy_version`; None: never set)."""
    by_reason: dict[str, int]
    """Delivered group items by reason (`complete`, `failed`, `timeout`, `closed`, `late`)."""

    @property
    def lag(self) -> int:
        """Group items delivered to the stream and not read by any consumer yet."""
        return self.unacked - self.pending


def feed_counts(r: redis.Redis, name: str) -> FeedCounts:
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.feed_counts(name))
    pipe.xlen(keys.feed_stream(name))
    pipe.zcard(keys.feed_open(name))
    raw, length, open_ = pipe.execute()
    try:
        pending = int(r.xpending(keys.feed_stream(name), keys.FEED_CONSUMER_GROUP)["pending"])
    except redis.ResponseError:  # no consumer group yet
        pending = 0
    counts = {k.decode(): int(v) for k, v in raw.items() if k != b"run_dir"}
    counts.pop("max_policy_lag", None)
    version = counts.get("policy_version")
    return FeedCounts(
        members=counts.get("members", 0),
        groups=counts.get("groups", 0),
        acked=counts.get("acked", 0),
        unacked=int(length),
        pending=pending,
        open=int(open_),
        closed=bool(counts.get("closed")),
        stale=counts.get("stale", 0),
        reruns=counts.get("reruns", 0),
        dropped=counts.get("dropped", 0),
        policy_version=version,
        by_reason={k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("delivered:")},
    )


def feed_status(r: redis.Redis, name: str) -> FeedStatus:
    """The feed's counts as the run keeps them (`ShardStatus.feed`)."""
    c = feed_counts(r, name)
    return FeedStatus(name=name, groups=c.groups, acked=c.acked, stale=c.stale, reruns=c.reruns,
                      dropped=c.dropped, policy_version=c.policy_version)  # fmt: skip
