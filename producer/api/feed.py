"""Reading a feed: `Feed(name).groups(consumer=...)` yields its groups as they complete, each
acknowledged once used (`await group.ack()`) (docs/how-to/feed.md).

Every consumer of a feed reads through one Redis Streams consumer group, so each group item goes
to one of them (trainer ranks share the work); an item read and not acknowledged stays pending on
its consumer and is claimed by a reader of the feed once idle `claim_after_s` (XAUTOCLAIM): a
consumer that died leaves nothing unread. A consumer restarted under its own name first gets
back what it held. Reading also delivers the groups past their deadline (`group_timeout_s`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from infra import keys
from infra.environment import from_env
from infra.feed import FeedCounts, ensure_group, expire_groups, feed_counts
from infra.feed_scripts import FEED_ACK_LUA, feed_keys
from schemas.errors import UsageError
from schemas.feed import FeedItem, FeedPlan
from schemas.settings import CollectionSettings

DEFAULT_CLAIM_AFTER_S = 60.0
READ_COUNT = 16
"""Items read per round trip."""


def feed_plan(
    settings: CollectionSettings, rows: list[dict[str, Any]], shard: str, recorded: bool
) -> FeedPlan | None:
    """The dispatch's feed and its groups, when `settings` names a feed (a recorded run only)."""
    if settings.feed is None:
        return None
    if not recorded:
        raise UsageError("a feed needs a recorded call: pass record_output_dir= with feed")
    return FeedPlan.of(
        settings.feed, rows, shard, settings.feed_group_key, settings.group_timeout_s
    )


@dataclass
class FeedGroup:
    """One group handed to a consumer; `ack()` once it is used."""

    item: FeedItem
    _feed: Feed = field(repr=False)

    @property
    def id(self) -> str:
        return self.item.id

    @property
    def group(self) -> str:
        return self.item.group

    @property
    def members(self) -> list[dict[str, Any]]:
        return self.item.members

    @property
    def incomplete(self) -> bool:
        return self.item.incomplete

    @property
    def reason(self) -> str:
        return self.item.reason

    async def ack(self) -> bool:
        """Acknowledge the group: it is never delivered again. True for the acknowledgement that
        took it (False: it was acknowledged already, by this consumer or one that claimed it)."""
        return (await self._feed.ack([self.id]))[0]


def _item(entry_id: bytes | str, fields: dict[bytes, bytes]) -> FeedItem:
    return FeedItem(
        id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        group=fields[b"group"].decode(),
        size=int(fields[b"size"]),
        reason=fields[b"reason"].decode(),  # type: ignore[arg-type]
        members=orjson.loads(fields[b"members"]),
    )


class Feed:
    """A feed, read by one or more consumers (`groups`)."""

    def __init__(
        self,
        name: str,
        redis_url: str | None = None,
        claim_after_s: float = DEFAULT_CLAIM_AFTER_S,
        block_s: float = 1.0,
    ) -> None:
        url = redis_url or from_env().redis_url or from_env().broker_url
        if not url:
            raise UsageError("Feed needs a Redis: pass redis_url= or set ROLLOUTS_REDIS_URL")
        self.name = name
        self.redis_url = url
        self.claim_after_s = claim_after_s
        self.block_s = block_s
        self._r = aioredis.Redis.from_url(url)
        self._sync = redis.Redis.from_url(url)
        self._ack = self._r.register_script(FEED_ACK_LUA)
        self._stream = keys.feed_stream(name)

    async def aclose(self) -> None:
        await self._r.aclose()
        self._sync.close()

    async def ack(self, ids: list[str]) -> list[bool]:
        """Acknowledge entries by id; a flag per id, True where this acknowledgement took it."""
        flags = await self._ack(keys=feed_keys(self.name), args=[keys.FEED_CONSUMER_GROUP, *ids])
        return [bool(f) for f in flags]

    def counts(self) -> FeedCounts:
        return feed_counts(self._sync, self.name)

    def _done(self) -> bool:
        c = self.counts()
        return c.closed and c.open == 0 and c.unacked == 0

    async def groups(self, consumer: str, until_closed: bool = True) -> AsyncIterator[FeedGroup]:
        """The feed's groups for `consumer` (a name stable across its restarts), as they come.

        With `until_closed` the iteration ends once the feed's run closed it and every group is
        acknowledged (by any consumer); else it goes on until the caller stops.
        """
        await asyncio.to_thread(ensure_group, self._sync, self.name)
        group = keys.FEED_CONSUMER_GROUP
        # What this consumer held before it restarted comes back first.
        own = await self._r.xreadgroup(group, consumer, {self._stream: "0"}, count=10_000)
        for item in self._entries(own):
            yield FeedGroup(item, self)
        claim_ms = int(self.claim_after_s * 1000)
        while True:
            await asyncio.to_thread(expire_groups, self._sync, self.name)
            claimed = await self._r.xautoclaim(
                self._stream, group, consumer, min_idle_time=claim_ms, start_id="0-0",
                count=READ_COUNT,
            )  # fmt: skip
            got = [_item(i, f) for i, f in claimed[1] if f]
            if not got:
                read = await self._r.xreadgroup(
                    group, consumer, {self._stream: ">"}, count=READ_COUNT,
                    block=int(self.block_s * 1000),
                )  # fmt: skip
                got = self._entries(read)
            for item in got:
                yield FeedGroup(item, self)
            if not got and until_closed and await asyncio.to_thread(self._done):
                return

    @staticmethod
    def _entries(reply: Any) -> list[FeedItem]:
        out: list[FeedItem] = []
        for _stream, entries in reply or []:
            out.extend(_item(i, f) for i, f in entries if f)
        return out
