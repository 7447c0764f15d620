"""Reading ahead: the finish step's pass over the results, started while the rollouts still land.

The finish step reads every result line once (count, aggregate, health check, report:
`workers/finish_pass.py`), about 170 µs a row of 64 KB, and only after the generation's last
rollout settled: at 32,768 such rows, 11 of the 13 seconds between the agent's last reply and the
run's end. The results file only grows while the generation runs (complete lines are never cut,
`workers/shard/state.py`), so the pass can fold each line as it lands instead:

- the worker process that lands a generation's results first (and, should it go, the next one to
  land) takes the shard's reader lock (`keys.shard_reading`, renewed while it lives, expiring
  with its leases when it is killed) and runs the finish step on a thread of its own, its
  results read as they are appended (`ReadAhead.lines`);
- once every rollout of the generation was counted (the settling that publishes the finish task),
  or once a finish task asks (`keys.shard_finish_asked`: a finish that came without it, as a
  stop's), the reader takes the finishing lock, closes the shard as the finish step does, reads
  the failure rows and the results' last lines, and ends the finish step, which records its
  result in the manifest;
- the finish task waits while a live reader of its generation holds the lock, then returns the
  result the manifest holds (`workers/finish.py`). A reader that stops (its process killed, the
  generation superseded, its shard shrank, an error) lets go of the lock, and the finish task
  runs the whole step itself, as without a reader.

Only a `rollouts run` generation (one whose settlings count toward a finish task) with
aggregation on is read ahead; `ROLLOUTS_FINISH_READ_AHEAD=0` turns it off.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from infra import generation, keys
from infra.environment import from_env
from infra.locks import drop_kept, take_kept
from infra.store import RunDir
from schemas.errors import TransientError
from schemas.messages import RunRef

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a reader looks for new lines and asks whether the generation settled (local
folders; an object store's LIST costs more: `POLL_S_LISTED`)."""
POLL_S_LISTED = 1.0
LULL_CHECK_BYTES = 1 << 20
"""Bytes read between looks at whether the file grew (a burst began), on a local folder."""
RETRY_S = 10.0
"""How often a process that lands a generation's results tries for its reader lock again."""


class Abandoned(Exception):
    """The reader stops: the finish task does the whole step."""


def ask_to_finish(r: redis.Redis, run: RunRef) -> None:
    """Tell a reader of `run`'s generation to end the finish step now (a finish task came), and
    wake it if it waits for new lines."""
    sid = keys.shard_id(RunDir(run.output_dir).url, run.shard)
    ttl = int(from_env().live_key_ttl_s)
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.shard_finish_asked(sid), run.token, ex=ttl)
    pipe.delete(keys.shard_finish_wake(sid))
    _push_wake(pipe, sid, run.token, ttl)
    pipe.execute()


def wake_reader(r: redis.Redis, sid: str, token: str) -> None:
    """Wake a reader of generation `token` waiting for new lines: its generation just settled
    (the settling that counted its last rollout calls this), and it goes on to end the finish
    step at once rather than at its next look (`POLL_S`) or when the finish task asks."""
    pipe = r.pipeline(transaction=False)
    _push_wake(pipe, sid, token, int(from_env().live_key_ttl_s))
    pipe.execute()


def _push_wake(pipe: redis.client.Pipeline, sid: str, token: str, ttl: int) -> None:
    """Queue on `pipe` the push that wakes a reader blocked on the shard's wake list."""
    pipe.rpush(keys.shard_finish_wake(sid), token)
    pipe.expire(keys.shard_finish_wake(sid), ttl)


def wait_for_reader(r: redis.Redis, sid: str, token: str, poll_s: float = 0.05) -> bool:
    """Wait while a live reader of generation `token` holds the shard's reader lock; whether one
    did (it ended the finish step, or stopped and left it to the caller)."""
    waited = False
    while True:
        holder = r.get(keys.shard_reading(sid))
        if not isinstance(holder, bytes) or not holder.startswith(f"{token}:".encode()):
            return waited
        waited = True
        time.sleep(poll_s)


class ReadAhead:
    """The results of one generation's shard, read as they land, for its finish step."""

    def __init__(self, r: redis.Redis, rd: RunDir, sid: str, token: str) -> None:
        self.r = r
        self.rd = rd
        self.sid = sid
        self.token = token
        self.poll_s = POLL_S if rd.can_append else POLL_S_LISTED
        self.settled_at: float | None = None
        """When the reader saw the generation settled (`time.monotonic()`)."""
        self.ahead_lines = 0
        """Lines read before the generation settled."""
        self.all_begun = False
        """Whether every rollout of the generation began (was admitted) when last asked: the
        last wave, during whose bursts no refill waits for the cores the pass takes."""

    def settled(self) -> bool:
        """Whether every rollout of the generation was counted, or a finish task asked; raises
        `Abandoned` once the generation is not the reader's any more."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(
            keys.shard_generation(self.sid),
            generation.TOKEN,
            generation.ENQUEUED,
            generation.COUNTED,
            *generation.COUNTERS,
        )
        pipe.get(keys.shard_finish_asked(self.sid))
        pipe.hlen(keys.shard_starts(self.sid))
        (token, enqueued, counted, *ended), asked, begun = pipe.execute()
        if token != self.token.encode():
            raise Abandoned("the generation was superseded")
        if asked == self.token.encode():
            return True
        # Released (counted in the generation) and begun but not released (`keys.shard_starts`):
        # every rollout was admitted once they make up what was enqueued.
        released = sum(int(n or 0) for n in ended)
        self.all_begun = int(enqueued or 0) > 0 and released + int(begun) >= int(enqueued)
        return int(enqueued or 0) > 0 and int(counted or 0) >= int(enqueued or 0)

    def lines(
        self, name: str, on_settled: Callable[[], None] | None = None
    ) -> Iterator[tuple[int, bytes | memoryview]]:
        """The complete lines of `name` as they are appended, until the generation settled; then
        `on_settled()` (the finish step closes the shard and reads the failure rows) and the
        lines appended until then.

        Lines are read while the file is quiet (it did not grow since the last look), and on a
        local folder only until it grows again (looked at every `LULL_CHECK_BYTES`): a wave of
        replies lands in a burst that keeps the workers' cores busy starting the next rollouts,
        and the pass waits for the lull after it rather than taking the burst's CPU (on two
        cores, reading along during the bursts delayed the last reply as much as it saved at the
        end). Once every rollout began (`all_begun`: the last wave) no start waits for those
        cores, and lines are read as they land: what the pass reads then is not left for after
        the last reply."""
        position = 0
        last_size = -1
        while True:
            size = self.rd.size(name)
            if size == last_size or self.all_begun:
                checked = position
                for offset, line in self.rd.iter_line_views(name, position):
                    position = offset + len(line) + 1
                    self.ahead_lines += 1
                    yield offset, line
                    if (
                        not self.all_begun
                        and self.rd.can_append
                        and position - checked >= LULL_CHECK_BYTES
                    ):
                        checked = position
                        if self.rd.size(name) > size:
                            break  # a burst began: wait for its lull
                size = self.rd.size(name) if self.rd.can_append else size
            last_size = size
            if self.settled():
                break
            # Until the next look, or at once when a finish task asks.
            self.r.blpop([keys.shard_finish_wake(self.sid)], timeout=self.poll_s)
        self.settled_at = time.monotonic()
        if on_settled is not None:
            on_settled()
        if self.rd.size(name) < position:
            raise Abandoned(f"{self.rd.path(name)} shrank below the lines read ahead")
        yield from self.rd.iter_line_views(name, position)


class _ReaderLock:
    """The shard's reader lock, `<token>:<holder>`, renewed by the process's lock keeper."""

    def __init__(self, r: redis.Redis, sid: str, token: str) -> None:
        self.r = r
        self.name = keys.shard_reading(sid)
        self.value = f"{token}:{os.getpid()}-{uuid.uuid4().hex}"
        """The generation, then this process (the pid) and this holder."""
        self.ttl_s = from_env().lease_ttl_s
        """A reader is one of its process's holders, as its rollouts are: killed, its lock
        expires when their leases do (`ROLLOUTS_LEASE_TTL_S`), and the finish task, which waits
        while the lock is held, goes on no later than the takeover of those rollouts."""

    def take(self) -> bool:
        if not take_kept(self.r, self.name, self.value, self.ttl_s):
            return False
        with _held_lock:
            _held[self.name] = self
        return True

    def release(self) -> None:
        with _held_lock:
            if _held.get(self.name) is self:
                del _held[self.name]
        drop_kept(self.r, self.name, self.value, self.ttl_s)


_held: dict[str, _ReaderLock] = {}
_held_lock = threading.Lock()
_tried: dict[tuple[str, str], float] = {}
"""When this process last tried for each (shard, generation)'s reader lock."""


@atexit.register
def _release_all() -> None:
    """A worker that stops lets the finish task go on at once, not after the lock expires."""
    with _held_lock:
        held = list(_held.values())
    for lock in held:
        lock.release()


def maybe_read_ahead(r: redis.Redis, run: RunRef, redis_url: str) -> None:
    """Called after this process landed results of `run`'s shard: start its reader here unless
    one runs (tried at most every `RETRY_S` per generation)."""
    if not from_env().finish_read_ahead or not _finisher:
        return
    url = RunDir(run.output_dir).url
    sid = keys.shard_id(url, run.shard)
    now = time.monotonic()
    if now - _tried.get((sid, run.token), -RETRY_S) < RETRY_S:
        return
    while len(_tried) > 1000:  # the generations this process tried for first go first
        del _tried[next(iter(_tried))]
    _tried.pop((sid, run.token), None)
    _tried[(sid, run.token)] = now
    try:
        gen = r.hmget(
            keys.shard_generation(sid), generation.TOKEN, generation.ENQUEUED, generation.FINISH
        )
        token, enqueued, finish = gen
        if token != run.token.encode() or not finish or not int(enqueued or 0):
            return  # not the running generation of a `rollouts run`
        signature = json.loads(finish)
        lock = _ReaderLock(r, sid, run.token)
        if not lock.take():
            return
    except (redis.RedisError, ValueError) as exc:
        log.debug("no reading ahead of %s: %s", url, exc)
        return
    thread = threading.Thread(
        target=_read,
        args=(lock, (sid, run.token), run, redis_url, signature),
        name="rollouts-read-ahead",
        daemon=True,
    )
    thread.start()


Finisher = Callable[[RunRef, str, redis.Redis, dict[str, Any]], object]
_finisher: list[Finisher] = []
"""The finish step run ahead (`workers.finish.finish_ahead`, which registers it on import: the
finish step imports this module, not the other way round)."""


def register(finisher: Finisher) -> None:
    _finisher[:] = [finisher]


def _read(
    lock: _ReaderLock,
    generation_key: tuple[str, str],
    run: RunRef,
    redis_url: str,
    signature: dict[str, Any],
) -> None:
    try:
        if not _finisher:
            raise Abandoned("the finish step is not loaded in this process")
        _finisher[0](run, redis_url, lock.r, signature)
    except (Abandoned, TransientError) as why:
        log.info("reading %s ahead stopped (%s): the finish task finishes it", run.output_dir, why)
    except Exception:
        log.exception("reading %s ahead failed: the finish task finishes it", run.output_dir)
    finally:
        # Whatever ended it (the step done, a stop that stays, an error), this process does not
        # read the generation ahead again.
        _tried[generation_key] = math.inf
        lock.release()
