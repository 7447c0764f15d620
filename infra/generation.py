"""The dispatch generation hash (`keys.shard_generation`): its fields, how they are written, how
they are read.

The producer writes it (`write_opening` when a generation starts, `write_counting` once its
rollout tasks are counted: `producer/shard/dispatch.py`); workers count into it from Lua
(`BEGIN_LUA`, `END_LUA` and `SETTLE_LUA` in `infra/scripts.py`, which use these field names as
literals and are checked against them by `tests/unit/test_scripts.py`); `rollouts status`, a reattached Python API call, a
stopped run and the finish step read it back (`read`, `Generation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from infra import keys

TOKEN = "token"
"""The generation's token: counters count only while it is the shard's current one."""
ENQUEUED = "enqueued"
"""Rollout tasks of the generation: every one is published at once, or a window at a time
(`workers/window.py`); the finish waits for all of them."""
STARTED_AT = "started_at"
"""When the generation started, on the Redis server's clock."""
DEADLINE = "deadline"
"""The dispatch budget's end on the Redis server's clock; empty without a budget."""
FINISH = "finish"
"""The finish task's signature (JSON), published by the settling that counts the last rollout."""
COUNTED = "counted"
"""Rollouts settled toward the finish so far, each once."""

DONE = "done"
DUPLICATE = "duplicate"
DRAINED = "drained"
"""Not started: the dispatch budget ran out."""
STOPPED = "stopped"
"""Not started: the run was cancelled or failed."""
CANCELLED = "cancelled"
"""Cancelled in flight."""
COUNTERS = (DONE, DUPLICATE, DRAINED, STOPPED, CANCELLED)
"""The generation's outcome counters; together they are the tasks that reached an end."""


def write_opening(
    pipe: redis.client.Pipeline,
    sid: str,
    token: str,
    enqueued: int,
    started_at: float,
    deadline: float | None,
) -> None:
    """Queue on `pipe` the fields a new generation starts with (its caller emptied the hash)."""
    pipe.hset(
        keys.shard_generation(sid),
        mapping={
            TOKEN: token,
            ENQUEUED: enqueued,
            STARTED_AT: repr(started_at),
            DEADLINE: repr(deadline) if deadline is not None else "",
        },
    )


def write_counting(
    pipe: redis.client.Pipeline, sid: str, token: str, enqueued: int, finish: str
) -> None:
    """Queue on `pipe` what makes the generation's settlings count toward `finish` from zero."""
    pipe.hdel(keys.shard_generation(sid), COUNTED)
    pipe.hset(
        keys.shard_generation(sid), mapping={TOKEN: token, ENQUEUED: enqueued, FINISH: finish}
    )


@dataclass(frozen=True)
class Generation:
    """The generation hash as read: its token, size, clock fields and outcome counters."""

    token: str | None = None
    enqueued: int = 0
    started_at: float | None = None
    deadline: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    """The `COUNTERS` present in the hash."""

    @classmethod
    def decode(cls, raw: Mapping[bytes, bytes]) -> Generation:
        """The generation of a `HGETALL` reply (empty when Redis holds none)."""
        gen = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            token=gen.get(TOKEN),
            enqueued=int(gen.get(ENQUEUED, 0)),
            started_at=float(gen[STARTED_AT]) if STARTED_AT in gen else None,
            deadline=float(gen[DEADLINE]) if gen.get(DEADLINE) else None,
            counters={k: int(v) for k, v in gen.items() if k in COUNTERS},
        )

    def count(self, name: str) -> int:
        """One outcome counter (0 when absent)."""
        return self.counters.get(name, 0)


def read(r: redis.Redis, sid: str) -> Generation:
    """Shard `sid`'s current generation."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_generation(sid))  # type: ignore[assignment]
    return Generation.decode(raw)
