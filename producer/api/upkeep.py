"""A call's upkeep beside its replies: marking the outcomes the caller took, and noticing that
Redis lost the call.

- A recorded call marks each outcome the caller took (`keys.api_consumed`) within
  LISTEN_TIMEOUT_S, so that a process that reattaches after the caller died
  (`producer/api/reattach.py`) yields only the others.
- The listener renews a mark of the call in Redis (`keys.api_call`) every WATCH_S. A mark that
  is gone means Redis restarted without its data: the queued rows, the leases, the replies not
  popped yet and the call's generation are gone with it. The call restores its generation and
  sends every published row without an outcome again (`_recover`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import redis

from infra import keys
from producer.api.feed import feed_plan
from producer.api.inventory import Inventory
from producer.api.model import Outcome, Target
from producer.shard.dispatch import open_generation
from schemas.outcomes import Ended
from workers.feed.rebuild import rebuild_feed
from workers.shard.state import key_str

log = logging.getLogger(__name__)

KEY_TTL_S = 24 * 3600
WATCH_S = 1.0
"""How often the listener checks that Redis still holds the call (`keys.api_call`)."""


class CallUpkeep:
    """Mixed into `producer.api.transport.Invocation`, whose state it reads."""

    invocation: str
    target: Target
    total: int
    sent: list[dict[str, Any]]
    losses: int
    _r: redis.Redis
    _sid: str
    _consumed: deque[int]
    _next_watch: float
    _closed: bool
    _published_at: list[float]
    _settled: bytearray

    def _settle(self, outcome: Outcome) -> None:
        raise NotImplementedError

    def _send(self, producer: Any, index: int, again: int = 0) -> None:
        raise NotImplementedError

    def consumed(self, index: int) -> None:
        """The caller took row `index`'s outcome (any thread): marked in Redis within
        LISTEN_TIMEOUT_S, so that a `reattach` after this process died does not yield it again."""
        if self.target.record:
            self._consumed.append(index)

    def _flush_consumed(self) -> None:
        if not self._consumed:
            return
        taken: list[int] = []
        while self._consumed:
            taken.append(self._consumed.popleft())
        name = keys.api_consumed(self.invocation)
        try:
            pipe = self._r.pipeline(transaction=False)
            for i in taken:
                pipe.setbit(name, i, 1)
            pipe.expire(name, KEY_TTL_S)
            pipe.execute()
        except redis.RedisError:
            self._consumed.extendleft(reversed(taken))
            raise

    def _watch(self) -> None:
        """Every WATCH_S: renew the call's mark in Redis; a mark that is gone means Redis lost
        the call's state (restarted without its data), and with it queued rows and replies."""
        now = time.monotonic()
        if now < self._next_watch or self._closed:
            return
        self._next_watch = now + WATCH_S
        if not self._r.expire(keys.api_call(self.invocation), KEY_TTL_S):
            self._recover()

    def _recover(self) -> None:
        """Send every published row that has no outcome again, after restoring the call's state.

        A rollout still running on a worker from before replies as usual (its settling needs no
        state); its copy runs it again, and the first reply wins. A recorded row that landed is
        read back from the shard instead, never run again; the lander keeps every rollout to one
        line (its landed keys are rebuilt from the shard's files).
        """
        self.losses += 1
        t = self.target
        self._r.set(keys.api_call(self.invocation), os.getpid(), ex=KEY_TTL_S)
        remaining = None
        if t.deadline is not None:
            sec, usec = self._r.time()
            remaining = max(0.0, t.deadline - (sec + usec / 1e6))
        open_generation(self._r, self._sid, t.run.token, self.total, remaining)
        feed = feed_plan(t.settings, self.sent, t.run.shard, t.record)
        if feed is not None:  # from the shard's files and the acknowledgement log
            rebuilt = rebuild_feed(self._r, feed, t.run.output_dir)
            log.warning("run_examples %s: feed %s rebuilt (%d members)", self.invocation,
                        feed.name, rebuilt)  # fmt: skip
        waiting = [i for i in range(self.total) if self._published_at[i] and not self._settled[i]]
        log.warning("run_examples %s: Redis lost the call's state (restarted without its data?); "
                    "sending its %d rows without an outcome again", self.invocation, len(waiting))  # fmt: skip
        if t.record and waiting:
            wanted = {key_str(self.sent[i]): i for i in waiting}
            found = Inventory.read(t.run.output_dir, t.run.shard, set(wanted)).landed
            for key, row in found.items():
                self._settle(Outcome(wanted[key], Ended.LANDED, row))
        with t.app.producer_or_acquire() as producer:
            for i in waiting:
                if not self._settled[i]:
                    self._send(producer, i, again=self.losses)
