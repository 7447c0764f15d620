"""Reading a feed: `Feed(name).groups(consumer=...)` yields its groups as they complete, each
acknowledged once used (`await group.ack()`) (docs/how-to/feed.md).

Every consumer of a feed reads through one Redis Streams consumer group, so each group item goes
to one of them (trainer ranks share the work); an item read and not acknowledged stays pending on
its consumer and is claimed by a reader of the feed once idle `claim_after_s` (XAUTOCLAIM): a
consumer that died leaves nothing unread. A consumer restarted under its own name first gets
back what it held. Reading also delivers the groups past their deadline (`group_timeout_s`).
A stream entry names where each member's line lies in the run directory; reading hands out the
rows read from there (`infra/feed_refs.py`).
The acknowledgement that takes a group is also logged on the run directory
(`infra/feed_log.py`); a reader rides out a Redis that restarts, and one that lost its data
(the producer rebuilds the feed, `workers/feed/rebuild.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from infra import keys
from infra.environment import from_env
from infra.feed import FeedCounts, ensure_group, expire_groups, feed_counts
from infra.feed_log import record_ack
from infra.feed_refs import RowReader
from infra.feed_scripts import FEED_ACK_LUA, feed_keys
from infra.store import RunDir
from schemas import fields as F
from schemas.errors import UsageError
from schemas.feed import FeedItem, FeedPlan, is_stale
from schemas.settings import CollectionSettings

log = logging.getLogger(__name__)

DEFAULT_CLAIM_AFTER_S = 60.0
RETRY_WAITS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
"""Waits between tries of an acknowledgement while Redis does not answer (half a minute)."""
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
    return settings.feed_plan(settings.feed, rows, shard)


@dataclass
class FeedGroup:
    """One group handed to a consumer; `ack()` once it is used."""

    item: FeedItem
    _feed: Feed = field(repr=False)
    consumer: str = ""
    """The consumer it was handed to."""
    stale: bool = False
    """A member ran under a policy version older than the current one less `max_policy_lag`."""

    @property
    def id(self) -> str:
        """The stream entry id (what `ack` acknowledges)."""
        return self.item.id

    @property
    def group(self) -> str:
        """The group's id."""
        return self.item.group

    @property
    def members(self) -> list[dict[str, Any]]:
        """The members' rows: a landed result, or the failure row a member settled with."""
        return self.item.members

    @property
    def incomplete(self) -> bool:
        """Whether the group lacks a result of some member (a failure row, or a member missing)."""
        return self.item.incomplete

    @property
    def reason(self) -> str:
        """Why it was delivered now (`schemas.feed.Delivered`: `complete`, `failed`, `timeout`, ...)."""
        return self.item.reason

    async def ack(self) -> bool:
        """Acknowledge the group: it is never delivered again. True for the acknowledgement that
        took it (False: it was acknowledged already, by this consumer or one that claimed it, or
        Redis lost it, and the rebuilt feed delivers it again). The one that took it is also
        logged on the run directory."""
        took = (await self._feed.ack([self.id]))[0]
        if took:
            await self._feed.log_ack(self)
        return took


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
        run_dir: str | None = None,
        max_policy_lag: int | None = None,
    ) -> None:
        """`run_dir`: where acknowledgements are logged; unset: the run directory the feed's
        dispatch named. `max_policy_lag=k`: a group with a member whose `_ng_policy_version` is
        older than the current version less k is handed out marked `stale` (and counted); unset:
        the run's `max_policy_lag` setting, if it has one."""
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
        self._run_dir = run_dir
        self._lost = False
        self._rows = RowReader()
        self.max_policy_lag = max_policy_lag

    async def aclose(self) -> None:
        await self._r.aclose()
        self._sync.close()

    async def ack(self, ids: list[str]) -> list[bool]:
        """Acknowledge entries by id; a flag per id, True where this acknowledgement took it."""
        args = [keys.FEED_CONSUMER_GROUP, *ids]
        for wait in RETRY_WAITS_S:
            try:
                flags = await self._ack(keys=feed_keys(self.name), args=args)
                return [bool(f) for f in flags]
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                return [False] * len(ids)  # Redis lost the feed: the entries with it
            except (redis.ConnectionError, redis.TimeoutError):
                await asyncio.sleep(wait)
        raise redis.ConnectionError(f"feed {self.name}: Redis did not come back to acknowledge")

    async def log_ack(self, group: FeedGroup) -> None:
        """Log `group`'s acknowledgement on the run directory (`infra/feed_log.py`)."""
        if self._run_dir is None:
            raw = await self._r.hget(keys.feed_counts(self.name), "run_dir")
            self._run_dir = raw.decode() if isinstance(raw, bytes) else raw
        if self._run_dir:
            rd = RunDir(self._run_dir)
            await asyncio.to_thread(
                record_ack, rd, self.name, group.group, group.members, group.consumer
            )

    def set_policy_version(self, version: int) -> None:
        """Advance the feed's policy version: rollouts that start from now on record it
        (`_ng_policy_version`), and `max_policy_lag` is counted from it."""
        pipe = self._sync.pipeline(transaction=True)
        pipe.hset(keys.feed_counts(self.name), "policy_version", int(version))
        pipe.expire(keys.feed_counts(self.name), int(from_env().live_key_ttl_s))
        pipe.execute()

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
        first = True
        while True:
            try:
                got = await self._read(consumer, first)
                first = False
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("feed %s: %s; reading again", self.name, exc)
                await asyncio.sleep(RETRY_WAITS_S[0])
                continue
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self._lost = (
                    True  # Redis lost the feed: its group is made again, its groups rebuilt
                )
                continue
            for item in got:
                yield FeedGroup(item, self, consumer, await self._stale(item))
            if not got and until_closed and await asyncio.to_thread(self._done):
                return

    async def _stale(self, item: FeedItem) -> bool:
        """Whether a member of `item` ran under a version older than the current one less
        `max_policy_lag` (as the trainer's version is when the item is handed out; the run's
        `max_policy_lag` unless this reader set its own); counted."""
        raw = await self._r.hmget(keys.feed_counts(self.name), ["policy_version", "max_policy_lag"])
        current = int(raw[0]) if raw[0] is not None else None
        lag = self.max_policy_lag
        if lag is None and raw[1] is not None:
            lag = int(raw[1])
        stale = any(
            is_stale(v if isinstance(v := m.get(F.POLICY_VERSION), int) else None, current, lag)
            for m in item.members
        )
        if stale:
            await self._r.hincrby(keys.feed_counts(self.name), "stale", 1)
        return stale

    async def _read(self, consumer: str, first: bool) -> list[FeedItem]:
        """The next items for `consumer`: what it held before it restarted (`first`), else what
        it claims from consumers idle past `claim_after_s`, else new ones (waiting `block_s`)."""
        group = keys.FEED_CONSUMER_GROUP
        if first or self._lost:
            await asyncio.to_thread(ensure_group, self._sync, self.name)
            self._lost = False
        if first:
            own = await self._r.xreadgroup(group, consumer, {self._stream: "0"}, count=10_000)
            return await self._resolved(self._entries(own))
        await asyncio.to_thread(expire_groups, self._sync, self.name)
        claimed = await self._r.xautoclaim(
            self._stream, group, consumer, min_idle_time=int(self.claim_after_s * 1000),
            start_id="0-0", count=READ_COUNT,
        )  # fmt: skip
        got = [_item(i, f) for i, f in claimed[1] if f]
        if got:
            return await self._resolved(got)
        read = await self._r.xreadgroup(
            group, consumer, {self._stream: ">"}, count=READ_COUNT, block=int(self.block_s * 1000)
        )
        return await self._resolved(self._entries(read))

    async def _resolved(self, items: list[FeedItem]) -> list[FeedItem]:
        """`items` with each member's row: a member the feed carries as a reference to its line
        in the shard's files is read from there (`infra/feed_refs.py`)."""
        if items:
            await asyncio.to_thread(self._resolve, items)
        return items

    def _resolve(self, items: list[FeedItem]) -> None:
        for item in items:
            item.members = self._rows.rows(item.members)

    @staticmethod
    def _entries(reply: Any) -> list[FeedItem]:
        out: list[FeedItem] = []
        for _stream, entries in reply or []:
            out.extend(_item(i, f) for i, f in entries if f)
        return out


async def tail(
    feed: Feed, consumer: str, out: Callable[[bytes], None], ack: bool, follow: bool
) -> int:
    """`rollouts feed`: write each group of `feed` for `consumer` as one JSON line to `out`,
    acknowledging it once written when `ack`; until the feed is closed and caught up, or for
    ever with `follow`. Returns how many groups were written."""
    n = 0
    async for group in feed.groups(consumer, until_closed=not follow):
        line = {**group.item.model_dump(), "stale": group.stale}
        out(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        if ack:
            await group.ack()
        n += 1
    return n


async def ack_ids(feed: Feed, ids: list[str], consumer: str) -> list[bool]:
    """Acknowledge entries by id (`rollouts feed --ack-id`), logging the ones taken as
    `FeedGroup.ack` does."""
    found = {}
    for entry in ids:
        got: Any = await feed._r.xrange(feed._stream, min=entry, max=entry)
        if got and got[0][1]:
            found[entry] = (await feed._resolved([_item(got[0][0], got[0][1])]))[0]
    flags = await feed.ack(ids)
    for entry, took in zip(ids, flags, strict=True):
        if took and entry in found:
            await feed.log_ack(FeedGroup(found[entry], feed, consumer))
    return flags
