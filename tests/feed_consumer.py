"""A trainer rank for the feed tests (`python -m tests.feed_consumer REDIS FEED CONSUMER LOG
HOLD_S CLAIM_AFTER_S`): reads the feed's groups, holds each `HOLD_S` (its "training step") and
acknowledges it, logging `ready` once started, then `got <group>` and `ack <group> <0|1>` lines as they happen, until the
feed is closed and every group acknowledged (or the test SIGKILLs it)."""

from __future__ import annotations

import asyncio
import os
import sys

from producer import Feed


async def main(redis_url: str, name: str, consumer: str, log: str, hold_s: float,
               claim_after_s: float) -> None:  # fmt: skip
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    feed = Feed(name, redis_url, claim_after_s=claim_after_s, block_s=0.2)
    os.write(fd, b"ready\n")
    try:
        async for group in feed.groups(consumer=consumer):
            os.write(fd, f"got {group.group}\n".encode())
            await asyncio.sleep(hold_s)
            took = await group.ack()
            os.write(fd, f"ack {group.group} {int(took)}\n".encode())
    finally:
        await feed.aclose()
        os.close(fd)


if __name__ == "__main__":
    url, feed_name, who, path, hold, claim = sys.argv[1:7]
    asyncio.run(main(url, feed_name, who, path, float(hold), float(claim)))
