"""The feed's Lua scripts on a real Redis: members gathered into groups, delivered once each,
late and expired ones marked, acknowledgements counted once."""

from __future__ import annotations

from typing import Any

import orjson
import redis

from infra import keys
from infra.feed import close_feed, feed_counts, open_feed
from infra.feed_scripts import FEED_ACK_LUA, FEED_LAND_LUA, feed_keys
from schemas.feed import FeedMember
from workers.feed.publish import Landed, queue_members


def land(r: redis.Redis, *members: tuple[str, int, str, bool], timeout_s: float = 60.0) -> None:
    """Land members (group, size, member key, failed) in one MULTI, as the lander does."""
    script = r.register_script(FEED_LAND_LUA)
    pipe = r.pipeline(transaction=True)
    landed = []
    for group, size, member, failed in members:
        row: dict[str, Any] = {"member": member}
        if failed:
            row["_ng_failure_class"] = "http_error"
        feed = FeedMember(name="f", group=group, size=size, timeout_s=timeout_s)
        landed.append(Landed(feed, member, orjson.dumps(row) + b"\n", failed))
    queue_members(pipe, script, landed)
    pipe.execute()


def entries(r: redis.Redis) -> list[tuple[str, str, list[str]]]:
    out = []
    fields: Any
    for _, fields in r.xrange(keys.feed_stream("f")) or []:
        members = [m["member"] for m in orjson.loads(fields[b"members"])]
        out.append((fields[b"group"].decode(), fields[b"reason"].decode(), sorted(members)))
    return out


def test_a_group_is_delivered_once_when_its_last_member_lands(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    land(r, ("g1", 2, "0:0", False), ("g2", 2, "1:0", False))
    assert entries(r) == []
    land(r, ("g1", 2, "0:1", False), ("g1", 2, "0:1", False))  # a redelivery: once
    land(r, ("g2", 2, "1:1", True))
    assert entries(r) == [("g1", "complete", ["0:0", "0:1"]), ("g2", "failed", ["1:0", "1:1"])]
    assert r.zcard(keys.feed_open("f")) == 0 and r.ttl(keys.feed_stream("f")) > 0


def test_close_delivers_open_groups_and_a_later_member_comes_alone(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    open_feed(r, "f", "runs/f")
    land(r, ("g1", 3, "0:0", False))
    assert close_feed(r, "f") == 1
    land(r, ("g1", 3, "0:1", False))
    assert entries(r) == [("g1", "closed", ["0:0"]), ("g1", "late", ["0:1"])]
    counts = feed_counts(r, "f")
    assert counts.closed and counts.groups == 2 and counts.members == 2 and counts.lag == 2


def test_an_entry_is_acknowledged_once(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    open_feed(r, "f", "runs/f")
    land(r, ("g1", 1, "0:0", False))
    read: Any = r.xreadgroup(keys.FEED_CONSUMER_GROUP, "c", {keys.feed_stream("f"): ">"})
    [[_, [(entry, _)]]] = read
    ack = r.register_script(FEED_ACK_LUA)
    args = [keys.FEED_CONSUMER_GROUP, entry]
    assert ack(keys=feed_keys("f"), args=args) == [1]
    assert ack(keys=feed_keys("f"), args=args) == [0]
    assert feed_counts(r, "f").acked == 1 and r.xlen(keys.feed_stream("f")) == 0


def test_a_feed_two_shards_write_closes_when_the_last_one_finishes(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    open_feed(r, "f", "runs/f", fresh=True, writer="shard-a")
    land(r, ("a/0", 2, "0:0", False))
    open_feed(r, "f", "runs/f", fresh=True, writer="shard-b")  # another writer: nothing dropped
    land(r, ("b/1", 2, "1:0", False))
    assert close_feed(r, "f", "shard-a") == 0  # b still writes: nothing delivered, not closed
    assert not feed_counts(r, "f").closed and feed_counts(r, "f").open == 2
    land(r, ("b/1", 2, "1:1", False))
    assert close_feed(r, "f", "shard-b") == 1  # the last one: what is open goes, closed
    assert entries(r) == [("b/1", "complete", ["1:0", "1:1"]), ("a/0", "closed", ["0:0"])]
    assert feed_counts(r, "f").closed
    open_feed(r, "f", "runs/f", fresh=True, writer="shard-c")  # a new run: the feed anew
    assert entries(r) == [] and not feed_counts(r, "f").closed
    land(r, ("c/0", 2, "0:0", False))
    # A run elsewhere on the same name while shard c never finished (its caller died): anew.
    open_feed(r, "f", "runs/g", fresh=True, writer="shard-d")
    assert feed_counts(r, "f").open == 0 and r.smembers(keys.feed_writers("f")) == {b"shard-d"}
