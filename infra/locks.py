"""The shard lock: a Redis lock with an expiry, extended by a heartbeat while it is held.

`held` is the plain lock. `held_reading` is the lander's: it takes the lock and reads the shard's
state in one round trip, and its release rides in the commit's transaction.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis
from redis.exceptions import LockError

from infra.environment import from_env
from infra.process import PerProcess
from infra.scripts import ACQUIRE_READING_LUA, EXTEND_LUA, RELEASE_LUA
from schemas.errors import TransientError

ACQUIRE_TIMEOUT_S = 120.0
# Held for one storage write (milliseconds): a waiter that slept redis-py's default 100 ms would
# leave the shard idle most of the time when several processes take turns.
ACQUIRE_POLL_S = 0.005


@contextmanager
def held(
    r: redis.Redis,
    name: str,
    ttl_s: float | None = None,
    acquire_timeout_s: float = ACQUIRE_TIMEOUT_S,
) -> Iterator[None]:
    """Hold lock `name`: it expires after `ttl_s` unless this process is alive to extend it.

    `ttl_s` defaults to `ROLLOUTS_LOCK_TTL_S` (how long a dead holder blocks the shard).

    A holder that dies (SIGKILL) leaves the lock to expire, so the shard is never locked forever;
    a live holder with a slow write keeps it by the heartbeat.
    """
    ttl_s = from_env().lock_ttl_s if ttl_s is None else ttl_s
    lock = r.lock(
        name,
        timeout=ttl_s,
        sleep=ACQUIRE_POLL_S,
        blocking_timeout=acquire_timeout_s,
        thread_local=False,
    )
    if not lock.acquire():
        raise TransientError(f"could not acquire {name} within {acquire_timeout_s:.0f}s")
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                lock.reacquire()
            except (LockError, redis.RedisError):
                return

    beat = threading.Thread(target=heartbeat, name=f"heartbeat:{name}", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        # Expired or lost with Redis: nothing left to release.
        with contextlib.suppress(LockError, redis.RedisError):
            lock.release()


class _Keeper:
    """One heartbeat thread per process, extending every lock the process holds."""

    def __init__(self, r: redis.Redis, ttl_s: float) -> None:
        self.r = r
        self.ttl_ms = int(ttl_s * 1000)
        self.held: dict[str, str] = {}
        self.lock = threading.Lock()
        self.extend = r.register_script(EXTEND_LUA)
        self.thread = threading.Thread(target=self._run, name="rollouts-lock-keeper", daemon=True)
        self.thread.start()

    def keep(self, name: str, token: str) -> None:
        """Extend lock `name` as `token`'s from now on."""
        with self.lock:
            self.held[name] = token

    def forget(self, name: str, token: str) -> None:
        """Stop extending lock `name`, if it is kept as `token`'s."""
        with self.lock:
            if self.held.get(name) == token:
                del self.held[name]

    def _run(self) -> None:
        while True:
            time.sleep(self.ttl_ms / 3000)
            with self.lock:
                held = list(self.held.items())
            for name, token in held:
                with contextlib.suppress(redis.RedisError):
                    self.extend(keys=[name], args=[token, self.ttl_ms])


_keepers: PerProcess[tuple[redis.Redis, float], _Keeper] = PerProcess(lambda k: _Keeper(*k))


def _keeper(r: redis.Redis, ttl_s: float) -> _Keeper:
    return _keepers.get((r, ttl_s))


def take_kept(r: redis.Redis, name: str, value: str, ttl_s: float) -> bool:
    """Take lock `name` as `value` if nobody holds it, without waiting; while held (until
    `drop_kept`), the process's keeper extends it every third of `ttl_s`, so a killed holder's
    expires after `ttl_s`."""
    if not r.set(name, value, nx=True, px=int(ttl_s * 1000)):
        return False
    _keeper(r, ttl_s).keep(name, value)
    return True


def drop_kept(r: redis.Redis, name: str, value: str, ttl_s: float) -> None:
    """Stop extending a lock `take_kept` took, and release it if it is still `value`'s."""
    _keeper(r, ttl_s).forget(name, value)
    with contextlib.suppress(redis.RedisError):  # else it expires
        r.register_script(RELEASE_LUA)(keys=[name], args=[value])


@dataclass
class HeldLock:
    """A held shard lock, with what was read when it was taken."""

    r: redis.Redis
    name: str
    token: str
    state: dict[str, str]
    """The shard's state hash as read with the lock."""
    present: list[bool]
    """The landed flags of the members asked about, in their order."""
    released: bool = False

    def __post_init__(self) -> None:
        self._release = self.r.register_script(RELEASE_LUA)

    def commit(self, pipe: redis.client.Pipeline) -> None:
        """Execute `pipe` with the release queued last: it happens with the commit, in the same
        round trip. If the commit fails the lock is still this holder's, released the plain way
        when `held_reading` exits (not left to expire while the next batch waits for it)."""
        self._release(keys=[self.name], args=[self.token], client=pipe)
        pipe.execute()
        self.released = True

    def release(self) -> None:
        if not self.released:
            self.released = True
            with contextlib.suppress(redis.RedisError):
                self._release(keys=[self.name], args=[self.token])


@contextmanager
def held_reading(
    r: redis.Redis,
    name: str,
    state_key: str,
    landed_key: str,
    members: list[str],
    ttl_s: float | None = None,
    acquire_timeout_s: float = ACQUIRE_TIMEOUT_S,
) -> Iterator[HeldLock]:
    """Hold lock `name` (as `held` does) and read the state hash and the members' landed flags.

    One round trip takes the lock and reads; the holder can fold the release into its commit
    (`HeldLock.commit`), so an uncontended batch costs two round trips in all.
    """
    ttl_s = from_env().lock_ttl_s if ttl_s is None else ttl_s
    token = uuid.uuid4().hex
    acquire = r.register_script(ACQUIRE_READING_LUA)
    ttl_ms = int(ttl_s * 1000)
    deadline = time.monotonic() + acquire_timeout_s
    while True:
        reply = acquire(keys=[name, state_key, landed_key], args=[token, ttl_ms, *members])
        if reply[0] == 1:
            break
        if time.monotonic() > deadline:
            raise TransientError(f"could not acquire {name} within {acquire_timeout_s:.0f}s")
        time.sleep(ACQUIRE_POLL_S)
    flat = reply[1]
    state = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
    lock = HeldLock(r, name, token, state, [bool(x) for x in reply[2]])
    keeper = _keeper(r, ttl_s)
    keeper.keep(name, token)
    try:
        yield lock
    finally:
        keeper.forget(name, token)
        lock.release()
