"""What a rollout task of a feed reads before it starts: whether the feed is full, and the policy
version it starts under.

A feed with `max_unconsumed_groups` holds at most that many groups delivered and not
acknowledged (its stream's length: an entry is deleted as it is acknowledged). A rollout task of
that feed asks before its lease and admission (`FeedGate.room`) and waits while the feed is full,
so collection pauses when the trainer stops reading and resumes as it catches up; rollouts that
started already finish, so the stream can pass the bound by the groups they complete. A
cancelled run's rollouts do not wait (admission stops them). The same round trip reads the
feed's policy version; the rollout's records carry the version read as it is admitted to call
its agent (`version`, `_ng_policy_version`).

With `stale_rollouts="rerun"` a rollout whose call ended stale reads the feed's version again
(`current`), and its row is set aside (`set_aside`) before it is run again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from infra import jsonl, keys
from infra.environment import from_env
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.feed import FeedMember, FeedState
from schemas.messages import RunRef
from workers.shard.coverage import STALE_MARK

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
            return FeedState(full=False, policy_version=self.version(feed))
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(keys.feed_stream(feed.name))
        pipe.exists(keys.shard_cancel(sid))
        pipe.hget(keys.feed_counts(feed.name), "policy_version")
        length, cancelled, raw = pipe.execute()
        bound = feed.max_unconsumed
        full = bound is not None and int(length) >= bound and not cancelled
        version = int(raw) if raw is not None else None
        self._versions[feed.name] = (self.clock(), version)
        return FeedState(full=full, policy_version=version)

    def version(self, feed: FeedMember) -> int | None:
        """The feed's policy version, as read at most `VERSION_KEPT_S` ago by this process."""
        at, version = self._versions.get(feed.name, (float("-inf"), None))
        if self.clock() - at > VERSION_KEPT_S:
            version = self.current(feed)
        return version

    def current(self, feed: FeedMember) -> int | None:
        """The feed's policy version, read now (None: never set)."""
        raw = self.r.hget(keys.feed_counts(feed.name), "policy_version")
        version = int(raw) if isinstance(raw, bytes | str) else None
        self._versions[feed.name] = (self.clock(), version)
        return version

    def set_aside(self, feed: FeedMember, run: RunRef, row: dict[str, Any], rerun: int) -> str:
        """Keep the stale result `row` as evidence, one object in the shard's `_superseded`
        folder (which no reader of the run selects from), and count its re-run (`reruns`);
        returns the object's name. `rerun`: which re-run of its rollout follows (1, 2, ...)."""
        key = f"{row.get(F.TASK_INDEX)}-{row.get(F.ROLLOUT_INDEX)}"
        folder = ShardFiles(run.shard).superseded
        name = f"{folder}/{key}.g{run.generation}{STALE_MARK}{rerun}.{uuid.uuid4().hex[:8]}.jsonl"
        RunDir(run.output_dir).write_atomic(name, jsonl.dumps_line(row))
        self.count(feed, "reruns")
        return name

    def count(self, feed: FeedMember, name: str) -> None:
        """Add one to the feed's count `name` (`reruns`, `dropped`)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(keys.feed_counts(feed.name), name, 1)
        pipe.expire(keys.feed_counts(feed.name), int(from_env().live_key_ttl_s))
        pipe.execute()
