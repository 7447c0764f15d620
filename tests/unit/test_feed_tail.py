"""`rollouts feed` writes each group as one JSON line with what a Python reader sees of it,
`stale` included (a trainer in another language decides on it as `FeedGroup.stale` does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from producer.api.feed import FeedGroup, tail
from schemas.feed import FeedItem


class _Reader:
    """A feed whose groups are given: the first fresh, the second stale."""

    async def groups(self, consumer: str, until_closed: bool = True) -> AsyncIterator[FeedGroup]:
        for n, stale in ((1, False), (2, True)):
            item = FeedItem(id=f"{n}-0", group=f"0/{n}", size=1, reason="complete", members=[{}])
            yield FeedGroup(item, self, consumer, stale)  # type: ignore[arg-type]


def test_each_line_says_whether_its_group_is_stale() -> None:
    lines: list[bytes] = []
    reader: Any = _Reader()
    assert asyncio.run(tail(reader, "rank0", lines.append, ack=False, follow=False)) == 2
    got = [orjson.loads(line) for line in lines]
    assert [(g["group"], g["stale"]) for g in got] == [("0/1", False), ("0/2", True)]
    assert set(got[0]) == {"id", "group", "size", "reason", "members", "stale"}
