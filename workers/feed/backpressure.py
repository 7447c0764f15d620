"""A feed's bound on unconsumed groups: a rollout of a full feed waits before it starts.

A feed with `max_unconsumed_groups` holds at most that many groups delivered and not
acknowledged (its stream's length: an entry is deleted as it is acknowledged). A rollout task of
that feed asks before its lease and admission (`FeedGate.full`) and waits while the feed is full,
so collection pauses when the trainer stops reading and resumes as it catches up; rollouts that
started already finish, so the stream can pass the bound by the groups they complete. A
cancelled run's rollouts do not wait (admission stops them).
"""

from __future__ import annotations

import redis

from infra import keys
from schemas.feed import FeedMember


class FeedGate:
    """Whether a rollout's feed is full (one round trip)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def full(self, feed: FeedMember, sid: str) -> bool:
        if feed.max_unconsumed is None:
            return False
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(keys.feed_stream(feed.name))
        pipe.exists(keys.shard_cancel(sid))
        length, cancelled = pipe.execute()
        return int(length) >= feed.max_unconsumed and not cancelled
