"""What a shard is doing right now, read from Redis: leases, waiting rollouts, generation counters.

The rollout leases (`workers/rollout/leases.py`) say who runs what: each running rollout's holder, stage,
last heartbeat and attempt, the holders that went silent and the rollouts taken over from them.

Files say what happened; Redis says what is happening (and the broker how much is queued).
Nothing here writes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypedDict

import redis
from celery import Celery

from infra import keys
from infra.generation import COUNTERS, Generation
from infra.slots import slot_agent
from schemas.messages import QUEUE
from workers.shard.leases import lease_rows


class RunningRolloutJson(TypedDict):
    """A running rollout as `rollouts status --json` shows it."""

    key: str
    holder: str
    stage: str
    attempt: int
    heartbeat_age_s: float
    running_s: float
    lost: list[str]
    expired: bool


@dataclass(frozen=True)
class RunningRollout:
    """One rollout's lease as `rollouts status` shows it."""

    key: str
    """`task:rollout`."""
    holder: str
    """The worker process (`host:pid`) running it; for a redispatched one, the process that took
    it over and published it again."""
    stage: str
    """admitted, calling, landing, or redispatched (published again, not picked up yet)."""
    attempt: int
    """1 for the first attempt; each takeover adds one."""
    heartbeat_age_s: float
    """Seconds since its holder last renewed it."""
    running_s: float
    """Seconds since this attempt took the lease."""
    lost: tuple[str, ...]
    """Holders that went silent on it, oldest first."""
    expired: bool
    """Its holder went silent and no live process took it over yet."""

    def as_json(self) -> RunningRolloutJson:
        return {
            "key": self.key, "holder": self.holder, "stage": self.stage, "attempt": self.attempt,
            "heartbeat_age_s": round(self.heartbeat_age_s, 1),
            "running_s": round(self.running_s, 1), "lost": list(self.lost),
            "expired": self.expired,
        }  # fmt: skip


def running_rollouts(r: redis.Redis, sid: str, now: float) -> list[RunningRollout]:
    """The shard's rollout leases at Redis time `now`, oldest attempt first."""
    found = []
    for row in lease_rows(r, sid):
        lost = tuple(h for h in str(row.get("lost", "")).split(",") if h)
        expiry = row.get("expiry")
        found.append(
            RunningRollout(
                key=row["key"],
                holder=str(row.get("holder", "")),
                stage=str(row.get("stage", "")),
                attempt=int(row.get("n", 1)),
                heartbeat_age_s=max(0.0, now - float(row.get("beat", now))),
                running_s=max(0.0, now - float(row.get("since", now))),
                lost=lost,
                expired=expiry is None or float(expiry) <= now,
            )
        )
    return sorted(found, key=lambda x: -x.running_s)


@dataclass
class LiveSnapshot:
    """A shard's live state at one instant."""

    token: str | None = None
    """The generation the counters belong to (None: Redis holds no generation, e.g. it restarted)."""
    enqueued: int = 0
    started_at: float | None = None
    deadline: float | None = None
    now: float = 0.0
    """Redis server time of the snapshot."""
    in_flight: int = 0
    in_flight_by_agent: Counter[str] = field(default_factory=Counter)
    waiting: int = 0
    finishing: bool = False
    """The finish step runs, or its task waits for the worker that read the shard ahead."""
    counters: dict[str, int] = field(default_factory=dict)
    """The generation's counters: done, duplicate, drained, stopped, cancelled."""
    shard_counts: dict[str, int] = field(default_factory=dict)
    """The landing counters: landed, duplicates, failed:<class> (rows)."""
    stop: str | None = None
    """Why the run stops: the first error (failed), or cancel / drain."""
    rollouts: list[RunningRollout] = field(default_factory=list)
    """The rollout leases of the shard, oldest attempt first."""
    health: dict[str, int] = field(default_factory=dict)
    """The live verdict counts' fields (`infra/keys.py`: `shard_health`)."""

    def silent_holders(self) -> list[str]:
        """Holders whose leases expired with nobody taking them over, and those taken over from."""
        return sorted({x.holder for x in self.rollouts if x.expired}
                      | {h for x in self.rollouts for h in x.lost})  # fmt: skip

    @property
    def resolved(self) -> int:
        """Tasks of this generation that reached an end."""
        c = self.counters
        return sum(c.get(k, 0) for k in COUNTERS)

    @property
    def active(self) -> bool:
        fresh = any(not x.expired for x in self.rollouts)
        return self.in_flight > 0 or self.waiting > 0 or self.finishing or fresh

    def signature(self) -> tuple[Any, ...]:
        return (
            self.token,
            tuple(sorted(self.counters.items())),
            tuple(sorted(self.shard_counts.items())),
        )


def _ints(raw: dict[bytes, bytes]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        with contextlib.suppress(ValueError):
            out[k.decode()] = int(v)
    return out


def snapshot(r: redis.Redis, sid: str) -> LiveSnapshot:
    """One consistent-enough read of the shard's live keys (one round trip)."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.shard_generation(sid))
    pipe.zrangebyscore(keys.shard_leases(sid), now, "+inf")
    pipe.zcount(keys.shard_waiting(sid), now, "+inf")
    # Finishing: the finish step runs, or its task waits for the worker that read the shard
    # ahead to end it (`workers/finish_ahead.py`).
    pipe.exists(keys.shard_finishing(sid))
    pipe.mget(keys.shard_reading(sid), keys.shard_finish_asked(sid))
    pipe.hgetall(keys.shard_counts(sid))
    pipe.mget(keys.shard_run_failed(sid), keys.shard_cancel(sid))
    pipe.hgetall(keys.shard_health(sid))
    gen_raw, leases, waiting, finishing, ahead, counts_raw, (failed, cancel), health = (
        pipe.execute()
    )
    gen = Generation.decode(gen_raw)
    reading, asked = ahead
    handed = isinstance(asked, bytes) and isinstance(reading, bytes)
    handed = handed and reading.startswith(asked + b":")
    snap = LiveSnapshot(now=now, waiting=int(waiting), finishing=bool(finishing) or handed)
    snap.token = gen.token
    snap.enqueued = gen.enqueued
    snap.started_at = gen.started_at
    snap.deadline = gen.deadline
    snap.counters = gen.counters
    for member in leases:
        snap.in_flight_by_agent[slot_agent(member.decode())] += 1
    snap.in_flight = len(leases)
    snap.shard_counts = _ints(counts_raw)
    snap.health = _ints(health)
    if isinstance(failed, bytes):
        snap.stop = f"failed: {failed.decode()}"
    elif isinstance(cancel, bytes):
        snap.stop = cancel.decode()
    snap.rollouts = running_rollouts(r, sid, now)
    return snap


def live_health(r: redis.Redis, sid: str) -> dict[str, int]:
    """The shard's live verdict counts' fields (empty once its keys expired)."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_health(sid))  # type: ignore[assignment]
    return _ints(raw)


def broker_queue_length(app: Celery) -> int | None:
    """Messages waiting in the rollouts queue (all runs), or None if the broker cannot say."""
    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1)
            _, count, _ = conn.default_channel.queue_declare(queue=QUEUE, passive=True)
            return int(count)
    except Exception as exc:
        # A queue that does not exist (Redis lost it, or nothing was ever sent) holds nothing.
        if "NOT_FOUND" in str(exc) or "not found" in str(exc).lower():
            return 0
        return None
