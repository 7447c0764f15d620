"""Members entering their feed: queued into the MULTI that commits their landing.

The lander calls `queue_members` with the members of a batch that landed new (a result, or the
failure row a rollout settled with), in the same transaction as the landed keys and counters: a
rollout is in its feed exactly when its shard records it as landed (docs/explanation/feed.md).
A member that knows where its line was appended enters as that place (`infra/feed_refs.py`), not
as the row.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import redis

from infra import keys
from infra.environment import from_env
from infra.feed_scripts import feed_keys
from schemas.feed import FeedMember


@dataclass(frozen=True)
class Landed:
    """One member that landed: its result's line or the failure row it settled with."""

    feed: FeedMember
    member: str
    """The rollout's `task:rollout` key."""
    line: bytes
    """Its JSONL line."""
    failed: bool
    ref: bytes | None = None
    """Where the line lies in the shard's files (`infra.feed_refs.line_ref`): the feed carries
    that instead of the line; None: the line itself."""


def queue_members(pipe: redis.client.Pipeline, script: redis.commands.core.Script,
                  members: list[Landed]) -> None:  # fmt: skip
    """Queue `script` (`FEED_LAND_LUA`) on `pipe` once per feed, with `members`."""
    by_feed: dict[str, list[bytes | str | int | float]] = defaultdict(list)
    for m in members:
        field = ("f:" if m.failed else "r:") + m.member
        value = m.ref if m.ref is not None else m.line.rstrip(b"\n")
        by_feed[m.feed.name] += [m.feed.group, m.feed.size, m.feed.timeout_s, field, value]
    for name, args in by_feed.items():
        head: list[bytes | str | int | float] = [
            keys.feed_group_prefix(name),
            int(from_env().live_key_ttl_s),
        ]
        script(keys=feed_keys(name), args=[*head, *args], client=pipe)
