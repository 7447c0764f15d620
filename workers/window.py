"""The queue window: a run's rollout tasks published a window at a time, by whoever settles them.

With the `queue_window` setting, `rollouts run` does not publish every rollout task at once: the
broker queue holds about `queue_window` tasks not yet started, and the rest wait in the shard's
materialized inputs (a resume's: in its resume inputs, `producer/shard/resume.py`). The shard's window hash (`keys.shard_window`) holds where the next row lies
(a byte offset), how many tasks went out and what every task is built from (`CollectMessages`,
as JSON). `QueueWindow.refill` publishes the next rows while there is room: the producer when
it opens the window and at each poll while it waits, a worker after the rollouts it settles (at
most every `SETTLED_EVERY_S`), and every worker's lease renewal for each shard with rows left
(`keys.WINDOWS`), so a run whose producer left (`--no-wait`, killed) still publishes every
row, and the settling that counts the last one publishes the finish as before.

One refiller at a time holds the window's lock (`REFILL_TAKE_LUA`); it publishes the rows, then
moves the cursor only if it is where it began (`REFILL_DONE_LUA`). A refiller that dies before
moving it, or outlives its lock, publishes some rows twice at worst: a copy's delivery finds its
rollout leased or settled and counts nothing (`workers/rollout/leases.py`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from infra import keys
from infra.environment import from_env
from infra.scripts import REFILL_DONE_LUA, REFILL_TAKE_LUA
from infra.store import RunDir
from workers.collect_messages import CollectMessages, TraceHeaders, publish_rows

log = logging.getLogger(__name__)

LOCK_S = 10.0
"""How long a refiller holds the window's lock at most: a dead one's refill waits this long."""

SETTLED_EVERY_S = 0.1
"""A worker process asks whether a shard's window has room at most this often after settlings
(asking after each one cost a round trip per rollout: 0.75x the rate of instant rollouts)."""

PRODUCER_SHARE = 0.25
"""A waiting producer refills a window once a quarter of it has room (each poll)."""

WORKER_SHARE = 0.75
"""A worker refills a window once three quarters of it have room: while its producer waits and
keeps it full, the workers spend no CPU publishing; without one, they keep it between a quarter
and full."""


@dataclass(frozen=True)
class WindowPlan:
    """A generation's window: its size, its rows (a shard's materialized or resume inputs), its tasks' ids."""

    window: int
    total: int
    """Rollout tasks of the generation: every row of the file."""
    run_dir: str
    inputs: str
    """The name in `run_dir` of the file of its rows."""
    group_id: str
    """The generation's group id, which every task carries with its row's index."""
    task_prefix: str
    """A task's id is `<task_prefix>.<rollout id>`."""


def open_window(
    pipe: redis.client.Pipeline, sid: str, token: str, plan: WindowPlan, messages: CollectMessages
) -> None:
    """Queue on `pipe` the window of generation `token`, nothing published yet."""
    spec = {**messages.to_json(), "plan": vars(plan)}
    pipe.delete(keys.shard_window(sid), keys.shard_window_lock(sid))
    pipe.hset(
        keys.shard_window(sid),
        mapping={
            "token": token,
            "window": plan.window,
            "total": plan.total,
            "published": 0,
            "cursor": 0,
            "messages": json.dumps(spec),
        },
    )
    pipe.expire(keys.shard_window(sid), from_env().live_key_ttl_s)
    pipe.sadd(keys.WINDOWS, sid)


@dataclass(eq=False)
class QueueWindow:
    """Refills the queue windows of the shards this process settles rollouts of."""

    app: Celery
    r: redis.Redis
    share: float = WORKER_SHARE
    """The share of a window that must have room before a refill publishes."""
    traced: TraceHeaders | None = None
    """The trace headers of each task published (the producer's: linked to its job span)."""
    host: str = field(init=False, default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    _specs: dict[tuple[str, str], tuple[CollectMessages, WindowPlan]] = field(
        init=False, default_factory=dict
    )
    _windowed: dict[str, bool] = field(init=False, default_factory=dict)
    """Whether each shard seen has a window with rows left (asked once, then kept by `tick`)."""
    _asked: dict[str, float] = field(init=False, default_factory=dict)
    """When a settling last asked whether each shard's window has room (monotonic)."""

    def __post_init__(self) -> None:
        self._take = self.r.register_script(REFILL_TAKE_LUA)
        self._done = self.r.register_script(REFILL_DONE_LUA)

    def settled(self, sid: str) -> int:
        """A rollout of shard `sid` settled: refill its window if it has one."""
        windowed = self._windowed.get(sid)
        if windowed is None:
            windowed = self._windowed[sid] = bool(self.r.sismember(keys.WINDOWS, sid))
        now = time.monotonic()
        if not windowed or now - self._asked.get(sid, 0.0) < SETTLED_EVERY_S:
            return 0
        self._asked[sid] = now
        return self.refill(sid)

    def tick(self) -> int:
        """Refill every window with rows left (the lease renewal's turn)."""
        sids = {m.decode() for m in self.r.smembers(keys.WINDOWS)}  # type: ignore[union-attr]
        self._windowed = {sid: sid in sids for sid in {*self._windowed, *sids}}
        return sum(self.refill(sid) for sid in sids)

    def refill(self, sid: str) -> int:
        """Publish shard `sid`'s next rows while its window has room; returns how many."""
        names = [keys.shard_window(sid), keys.shard_generation(sid),
                 keys.shard_rollout_leases(sid), keys.shard_window_lock(sid), keys.WINDOWS]  # fmt: skip
        holder = f"{self.host}:{uuid.uuid4().hex[:8]}"
        room, cursor, published, raw_token = self._take(
            keys=names, args=[holder, int(LOCK_S * 1000), sid, self.share], client=self.r
        )
        if room < 0:
            self._windowed[sid] = False
            for spec in [spec for spec in self._specs if spec[0] == sid]:
                del self._specs[spec]
        if room <= 0:
            return 0
        token = raw_token.decode() if isinstance(raw_token, bytes) else str(raw_token)
        lock = [keys.shard_window(sid), keys.shard_window_lock(sid)]
        try:
            end, sent = self._publish(sid, token, int(cursor), int(published), int(room))
        except BaseException:
            self._done(keys=lock, args=[holder, "", "", 0, 0], client=self.r)
            raise
        ttl = from_env().live_key_ttl_s
        self._done(keys=lock, args=[holder, cursor, end, sent, ttl], client=self.r)
        return sent

    def _publish(self, sid: str, token: str, cursor: int, index: int, room: int) -> tuple[int, int]:
        """Publish up to `room` rows from byte `cursor`, the first with index `index`; returns
        (the byte after the last row published, how many)."""
        messages, plan = self._spec(sid, token)
        batch: list[tuple[int, dict[str, Any]]] = []
        end = cursor
        for line_end, row in RunDir(plan.run_dir).iter_objects(plan.inputs, cursor):
            if row is None:
                continue
            batch.append((index + len(batch), row))
            end = line_end
            if len(batch) == room:
                break
        sent = publish_rows(self.app, messages, batch, plan.group_id, plan.task_prefix, self.traced)
        return end, sent

    def _spec(self, sid: str, token: str) -> tuple[CollectMessages, WindowPlan]:
        spec = self._specs.get((sid, token))
        if spec is None:
            raw = self.r.hget(keys.shard_window(sid), "messages")
            data = json.loads(raw)  # type: ignore[arg-type]
            plan = WindowPlan(**data.pop("plan"))
            spec = self._specs[(sid, token)] = (CollectMessages.from_json(data), plan)
        return spec
