"""A run's feed at dispatch (`rollouts run --feed`): its groups counted from the shard's
materialized inputs, and the feed opened before the first task is sent (docs/how-to/feed.md)."""

from __future__ import annotations

import redis

from infra import keys
from infra.feed import open_feed
from producer.shard.opening import OpenedRun, iter_materialized
from schemas.feed import FeedPlan
from schemas.settings import CollectionSettings
from workers.feed.rebuild import rebuild_feed


def shard_feed(r: redis.Redis, opened: OpenedRun, settings: CollectionSettings) -> FeedPlan | None:
    """The feed of the shard's dispatch, opened; None when the run has none.

    Every planned row counts toward its group's size, a resume's too: a group is delivered when
    every planned member settled, whichever generation ran it. A resume also rebuilds the feed
    from the shard's files and its acknowledgement log (a no-op when Redis kept it)."""
    if settings.feed is None:
        return None
    shard = opened.manifest.shard
    rows = iter_materialized(opened.rd, shard)
    plan = settings.feed_plan(settings.feed, rows, shard)
    fresh = opened.run.generation == 0
    writer = keys.shard_id(opened.rd.url, shard)
    open_feed(r, plan.name, opened.rd.url, fresh=fresh, max_lag=plan.max_lag, writer=writer)
    if not fresh:  # a resume: what Redis may have lost since (a restart) comes back, once
        rebuild_feed(r, plan, opened.rd.url)
    return plan
