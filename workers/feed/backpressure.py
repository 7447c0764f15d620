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

import time
from collections.abc import Callable

import redis

from infra import keys
from schemas.feed import FeedMember, FeedState

VERSION_KEPT_S = 0.5
"""Without a bound, a process reads a feed's policy version at most this often: a rollout
records the version of at most half a second before it started, for no round trip of its own."""


class FeedGate:
    """A feed's room and policy version, in one round trip."""

    def __init__(self, r: redis.Redis, clock: Callable[[], float] = time.monotonic) -> None:
        self.r = r
        self.clock = clock
        self._versions: dict[str, tuple[float, int | None]] = {}

    def room(self, feed: FeedMember, sid: str) -> FeedState:
        if feed.max_unconsumed is None:
            at, version = self._versions.get(feed.name, (float("-inf"), None))
            if self.clock() - at > VERSION_KEPT_S:
                raw = self.r.hget(keys.feed_counts(feed.name), "policy_version")
                version = int(raw) if isinstance(raw, bytes | str) else None
                self._versions[feed.name] = (self.clock(), version)
            return FeedState(full=False, policy_version=version)
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(keys.feed_stream(feed.name))
        pipe.exists(keys.shard_cancel(sid))
        pipe.hget(keys.feed_counts(feed.name), "policy_version")
        length, cancelled, version = pipe.execute()
        bound = feed.max_unconsumed
        full = bound is not None and int(length) >= bound and not cancelled
        return FeedState(full=full, policy_version=int(version) if version is not None else None)
