"""A trainer rank for the feed tests (`python -m tests.feed_consumer REDIS FEED CONSUMER LOG
HOLD_S CLAIM_AFTER_S [ADVANCE_EVERY]`): reads the feed's groups, holds each `HOLD_S` (its
"training step") and acknowledges it, logging `ready` once started, then `got <group>` and `ack
<group> <0|1>` lines as they happen, until the feed is closed and every group acknowledged (or
the test SIGKILLs it). With `ADVANCE_EVERY` it sets the feed's policy version to 0 as it starts
and advances it by one every that many groups; each `got` line then goes on with whether the
group came stale, the version as it was handed out, and each member's `<version>/<re-runs>`."""

from __future__ import annotations

import asyncio
import os
import sys

from producer import Feed
from schemas import fields as F


async def main(redis_url: str, name: str, consumer: str, log: str, hold_s: float,
               claim_after_s: float, advance_every: int | None) -> None:  # fmt: skip
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    feed = Feed(name, redis_url, claim_after_s=claim_after_s, block_s=0.2)
    version = 0
    if advance_every is not None:
        feed.set_policy_version(version)
    os.write(fd, b"ready\n")
    try:
        n = 0
        async for group in feed.groups(consumer=consumer):
            got = f"got {group.group}"
            if advance_every is not None:
                members = [f"{m.get(F.POLICY_VERSION)}/{m.get(F.STALE_RERUNS, 0)}"
                           for m in group.members]  # fmt: skip
                got += f" {int(group.stale)} {version} {' '.join(members)}"
            os.write(fd, f"{got}\n".encode())
            await asyncio.sleep(hold_s)
            took = await group.ack()
            os.write(fd, f"ack {group.group} {int(took)}\n".encode())
            n += 1
            if advance_every is not None and n % advance_every == 0:
                version += 1
                feed.set_policy_version(version)
    finally:
        await feed.aclose()
        os.close(fd)


if __name__ == "__main__":
    url, feed_name, who, path, hold, claim = sys.argv[1:7]
    every = int(sys.argv[7]) if len(sys.argv) > 7 else None
    asyncio.run(main(url, feed_name, who, path, float(hold), float(claim), every))
