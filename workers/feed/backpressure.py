"""What a rollout task of a feed reads before it starts: whether the feed is full, and the policy
version it starts under.

A feed with `max_unconsumed_groups` holds at most that many groups delivered and not
acknowledged (its stream's length: an entry is deleted as it is acknowledged). A rollout task of
that feed asks before its lease and admission (`FeedGate.room`) and waits while the feed is full,
so collection pauses when the trainer stops reading and resumes as it catches up; rollouts that
started already finish, so the stream can pass the bound by the groups they complete. A
cancelled run's rollouts do not wait (admission stops them). The same round trip reads the
feed's policy version, which the rollout's records carry (`_ng_policy_version`).
"""

from __future__ import annotations

import redis

from infra import keys
from schemas.feed import FeedMember, FeedState


class FeedGate:
    """A feed's room and policy version, in one round trip."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def room(self, feed: FeedMember, sid: str) -> FeedState:
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(keys.feed_stream(feed.name))
        pipe.exists(keys.shard_cancel(sid))
        pipe.hget(keys.feed_counts(feed.name), "policy_version")
        length, cancelled, version = pipe.execute()
        bound = feed.max_unconsumed
        full = bound is not None and int(length) >= bound and not cancelled
        return FeedState(full=full, policy_version=int(version) if version is not None else None)
