"""The landed keys of a shard in Redis, in their compact form: the exactly-once guard.

A key `task:rollout` that landed is one bit: bit `task` of the bitmap of rollout index
`rollout` (`keys.shard_landed_bits`), so a shard of 1M rollouts of one repeat holds a 125 KB
string instead of a 1M-member set (~60 MB). A key that would make a bitmap sparse (a rollout
index from `keys.LANDED_BITS_ROLLOUTS` on, or a caller-stamped task index far above what the
shard planned) is a member of the landed set (`keys.shard_landed`) instead. Which form a key
takes is the writer's choice; a reader asks both (`present` here, and the same function in the
Lua of admission and of the lock's first read, `infra/scripts.py`), so no reader depends on the rule.

Like every key of the shard, it is rebuilt from the shard's files (`workers/shard/state.py`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, MutableSet, Sequence
from typing import Any

import redis

from infra import keys
from workers.shard.keyset import Key, KeySet

BITS_PER_TASK_PLANNED = 16
"""A task index below this many times the shard's planned rollouts gets a bit (sparser ones go
in the set): a shard's bitmaps hold at most 2 bytes per planned rollout per rollout index."""
MIN_BITS = 1 << 16
"""Task indexes below this always get a bit (8 KB a bitmap at most)."""
MAX_BIT = 1 << 32
"""Redis's largest bitmap offset, plus one."""
BITFIELD_BATCH = 10_000
"""Bits set per BITFIELD command."""


def split_key(key: str) -> tuple[int, int]:
    task, rollout = key.split(":", 1)
    return int(task), int(rollout)


def bit_of(key: str, planned: int) -> tuple[int, int] | None:
    """(rollout, task) when `key` is kept as a bit in a shard of `planned` rollouts, else None."""
    task, rollout = split_key(key)
    if rollout < keys.LANDED_BITS_ROLLOUTS and task < max(
        MIN_BITS, BITS_PER_TASK_PLANNED * planned
    ):
        return rollout, task
    return None


def add(
    pipe: redis.client.Pipeline, sid: str, planned: int, landed: Iterable[str], ttl_s: int
) -> None:
    """Queue in `pipe`: the keys `landed` landed (bits where they fit, else set members); the
    keys written expire `ttl_s` from now."""
    bits: dict[int, list[int]] = defaultdict(list)
    members: list[str] = []
    for key in landed:
        found = bit_of(key, planned)
        if found is None:
            members.append(key)
        else:
            bits[found[0]].append(found[1])
    for rollout, tasks in sorted(bits.items()):
        name = keys.shard_landed_bits(sid, rollout)
        for i in range(0, len(tasks), BITFIELD_BATCH):
            args: list[str | int] = []
            for task in tasks[i : i + BITFIELD_BATCH]:
                args += ["SET", "u1", task, 1]
            pipe.execute_command("BITFIELD", name, *args)  # type: ignore[no-untyped-call]
        pipe.expire(name, ttl_s)
    for i in range(0, len(members), BITFIELD_BATCH):
        pipe.sadd(keys.shard_landed(sid), *members[i : i + BITFIELD_BATCH])
    if members:
        pipe.expire(keys.shard_landed(sid), ttl_s)


def add_keyset(pipe: redis.client.Pipeline, sid: str, found: MutableSet[Key], ttl_s: int) -> None:
    """Queue in `pipe`: the keys of `found` landed, a `KeySet`'s bitmaps written as they are
    (a rebuild: no list of a million keys in memory)."""
    if not isinstance(found, KeySet):
        add(pipe, sid, 0, (f"{t}:{r}" for t, r in found), ttl_s)
        return
    for rollout, bits in found.bitmaps():  # rollout indexes below LANDED_BITS_ROLLOUTS
        pipe.set(keys.shard_landed_bits(sid, rollout), bits, ex=ttl_s)
    rest = [f"{t}:{r}" for t, r in found.others()]
    for i in range(0, len(rest), BITFIELD_BATCH):
        pipe.sadd(keys.shard_landed(sid), *rest[i : i + BITFIELD_BATCH])
    if rest:
        pipe.expire(keys.shard_landed(sid), ttl_s)


def read_keyset(r: redis.Redis, sid: str) -> KeySet:
    """Every landed key of the shard, read from Redis into a `KeySet` (bitmaps as they are)."""
    pipe = r.pipeline(transaction=False)
    for rollout in range(keys.LANDED_BITS_ROLLOUTS):
        pipe.get(keys.shard_landed_bits(sid, rollout))
    pipe.smembers(keys.shard_landed(sid))
    *bitmaps, members = pipe.execute()
    out = KeySet()
    for rollout, bits in enumerate(bitmaps):
        if bits:
            out.add_bitmap(rollout, bytes(bits))
    for member in members:
        out.add(split_key(member.decode() if isinstance(member, bytes) else str(member)))
    return out


def names(sid: str) -> list[str]:
    """Every key that holds the shard's landed keys."""
    return [
        keys.shard_landed(sid),
        *(keys.shard_landed_bits(sid, rollout) for rollout in range(keys.LANDED_BITS_ROLLOUTS)),
    ]


def delete(pipe: redis.client.Pipeline, sid: str) -> None:
    """Queue in `pipe`: forget every landed key of the shard."""
    pipe.delete(*names(sid))


def present(
    r: redis.Redis, sid: str, landed: Sequence[str], script: Any | None = None
) -> list[bool]:
    """Whether each key of `landed` landed: its bit, else its set member (one round trip).

    `script`: `LANDED_LUA` registered on `r`, to ask in one script call instead of a pipeline
    (the lander's way); without it, it works on a Redis without scripting too.
    """
    if not landed:
        return []
    if script is not None:
        flags = script(keys=[keys.shard_landed(sid)], args=list(landed), client=r)
        return [bool(f) for f in flags]
    pipe = r.pipeline(transaction=False)
    with_bit: list[int] = []
    for i, key in enumerate(landed):
        task, rollout = split_key(key)
        if rollout < keys.LANDED_BITS_ROLLOUTS and task < MAX_BIT:
            pipe.getbit(keys.shard_landed_bits(sid, rollout), task)
            with_bit.append(i)
    pipe.smismember(keys.shard_landed(sid), list(landed))
    *bits, members = pipe.execute()
    flags = [bool(m) for m in members]
    for i, bit in zip(with_bit, bits, strict=True):
        flags[i] = flags[i] or bool(bit)
    return flags


def settled(r: redis.Redis, sid: str, token: str, key: str) -> bool:
    """Whether `key` settled in generation `token` (`keys.shard_settled`: its bit, else its set
    member, written by `SETTLE_LUA` in the same layout as the landed keys)."""
    task, rollout = split_key(key)
    pipe = r.pipeline(transaction=False)
    pipe.sismember(keys.shard_settled(sid, token), key)
    if rollout < keys.LANDED_BITS_ROLLOUTS and task < MAX_BIT:
        pipe.getbit(keys.shard_settled_bits(sid, token, rollout), task)
    return any(pipe.execute())


def count(r: redis.Redis, sid: str) -> int:
    """How many keys of the shard landed (one round trip)."""
    pipe = r.pipeline(transaction=False)
    pipe.scard(keys.shard_landed(sid))
    for name in names(sid)[1:]:
        pipe.bitcount(name)
    return sum(int(n) for n in pipe.execute())
