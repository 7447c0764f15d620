"""One Redis client per process and URL, rebuilt after a fork; connections bounded and released
when idle.

A worker's threads share a few connections: each Redis call holds one for well under a
millisecond, so `ROLLOUTS_REDIS_MAX_CONNECTIONS` (default 64) serves hundreds of threads, and a
thread that finds them all busy waits for one (up to `POOL_TIMEOUT_S`) instead of opening
another. A pool nobody used for `ROLLOUTS_REDIS_IDLE_S` (default 60 s) closes its free
connections; the next call opens one again. The Celery result backend of a worker uses the same
kind of pool (`workers/app.py`), so a worker between runs holds only its broker connections.
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from infra.environment import from_env
from infra.process import PerProcess

POOL_TIMEOUT_S = 30.0
"""How long a call waits for a free connection before it fails as a connection error."""


class IdleReleasingPool(redis.BlockingConnectionPool):
    """A bounded, blocking pool that knows when it was last used."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_connections", from_env().redis_max_connections)
        kwargs.setdefault("timeout", POOL_TIMEOUT_S)
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.last_used = time.monotonic()
        _reaper.get(None).watch(self)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.last_used = time.monotonic()
        return super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    def open_connections(self) -> int:
        """Connections with a socket open, free or in use."""
        with self._lock:
            return sum(1 for c in self._connections if getattr(c, "_sock", None) is not None)

    def release_if_idle(self, idle_s: float, now: float) -> None:
        """Close the free connections if nothing took one for `idle_s`."""
        if now - self.last_used >= idle_s:
            self.disconnect(inuse_connections=False)


class _Reaper:
    """One daemon thread per process closing the free connections of idle pools."""

    def __init__(self, _key: None) -> None:
        self.idle_s = from_env().redis_idle_s
        self._pools: weakref.WeakSet[IdleReleasingPool] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rollouts-redis-idle", daemon=True)
        self._thread.start()

    def watch(self, pool: IdleReleasingPool) -> None:
        with self._lock:
            self._pools.add(pool)

    def _loop(self) -> None:
        while True:
            time.sleep(max(0.5, self.idle_s / 4))
            with self._lock:
                pools = list(self._pools)
            now = time.monotonic()
            for pool in pools:
                pool.release_if_idle(self.idle_s, now)


_reaper: PerProcess[None, _Reaper] = PerProcess(_Reaper)


def _no_factory(key: str) -> IdleReleasingPool:
    raise AssertionError(f"shared_pool makes its pools ({key})")


_pools: PerProcess[str, IdleReleasingPool] = PerProcess(_no_factory)


def shared_pool(**params: Any) -> IdleReleasingPool:
    """This process's one pool for these connection parameters. Celery's result backend makes a
    backend per thread, each asking for a pool with equal parameters (and its own `driver_info`
    object): they all get this one."""
    key = repr(sorted((k, repr(v)) for k, v in params.items()))
    return _pools.get(key, lambda: IdleReleasingPool(**params))


def _connect(url: str) -> redis.Redis:
    pool = IdleReleasingPool.from_url(
        url, health_check_interval=30, socket_keepalive=True, retry_on_timeout=True
    )
    return redis.Redis(connection_pool=pool)


_clients: PerProcess[str, redis.Redis] = PerProcess(_connect)


def client(url: str) -> redis.Redis:
    """A shared client for `url` in this process (a bounded pool shared by its threads)."""
    return _clients.get(url)


BATCH_HEAD = "local function one(KEYS, ARGV)\n"
BATCH_TAIL = """
end
-- The script above, once for each call of a batch (infra/redis_client.run_scripts). ARGV holds
-- three values a call: where its keys start in KEYS (from 0: a key list many calls share is
-- named once), how many it has, and its arguments as a JSON array of strings. The answer is
-- {1, answer} a call, or {0, message} for one that raised: an error stops no other call, as in
-- a pipeline of the script's calls.
local out = {}
for i = 1, #ARGV, 3 do
  local start, count = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local keys = {}
  for j = 1, count do keys[j] = KEYS[start + j] end
  local ok, answer = pcall(one, keys, cjson.decode(ARGV[i + 2]))
  if ok then
    out[#out + 1] = {1, answer}
  else
    out[#out + 1] = {0, type(answer) == 'table' and answer.err or tostring(answer)}
  end
end
return out
"""


@dataclass(frozen=True)
class _Batched:
    sha: str
    source: str


_batched: dict[str, _Batched] = {}


def batched_source(script: str) -> _Batched:
    """The batch form of a script's source (`BATCH_HEAD` + it + `BATCH_TAIL`) and its digest."""
    found = _batched.get(script)
    if found is None:
        source = BATCH_HEAD + script + BATCH_TAIL
        found = _batched[script] = _Batched(hashlib.sha1(source.encode()).hexdigest(), source)
    return found


def _arg_text(value: Any) -> str:
    """An argument as the text Redis would get from redis-py's encoder (TypeError: no text)."""
    kind = type(value)
    if kind is str:
        return value  # type: ignore[no-any-return]
    if kind is bytes:
        return value.decode()  # type: ignore[no-any-return]
    if kind is int or kind is float:
        return repr(value)
    raise TypeError(f"no batch text for {kind.__name__}")


def run_scripts(
    r: redis.Redis, script: Any, prepared: list[tuple[list[str], list[Any]]]
) -> list[Any]:
    """`script` (a registered `redis.commands.core.Script`) once per (keys, args) of `prepared`,
    in one round trip: each call's answer, or its error (a `ResponseError`), in its place. A
    connection error raises for all.

    Two calls or more go as one call of the script's batch form (`BATCH_TAIL`: each distinct key
    list named once, each call's arguments one JSON text): packing a call's thirty-odd keys and
    arguments one by one cost its client more than Redis's running of it (an admission: 60 µs
    of the client's CPU in a pipeline, 16 µs in a batch; Redis's time unchanged). Each call is
    atomic, as before; the batch as a whole is too: Redis serves no other client while it runs
    (a gathered step sends at most 512 calls, tens of milliseconds of scripts; a pipeline's
    calls could be served between other clients' commands). Arguments with no such text
    (anything but str, UTF-8 bytes, int and float) go in a pipeline of the script's calls
    instead. Calls Redis did not know the script for (it restarted) are sent again once it is
    loaded; should it not know it even then, each call gets that error.
    """
    if len(prepared) > 1:
        try:
            texts = [orjson.dumps([_arg_text(a) for a in args]) for _, args in prepared]
        except (TypeError, UnicodeDecodeError):
            pass
        else:
            return _run_batch(r, batched_source(script.script), prepared, texts)
    return _run_pipeline(r, script, prepared)


def _run_batch(
    r: redis.Redis,
    batch: _Batched,
    prepared: list[tuple[list[str], list[Any]]],
    texts: list[bytes],
) -> list[Any]:
    names: list[str] = []
    starts: dict[tuple[str, ...], int] = {}
    argv: list[Any] = []
    missing: redis.exceptions.NoScriptError | None = None
    for (call_keys, _), text in zip(prepared, texts, strict=True):
        group = tuple(call_keys)
        start = starts.get(group)
        if start is None:
            start = starts[group] = len(names)
            names.extend(call_keys)
        argv += (start, len(call_keys), text)
    for _ in range(2):
        try:
            answers = r.evalsha(batch.sha, len(names), *names, *argv)
        except redis.exceptions.NoScriptError as exc:
            missing = exc
            r.script_load(batch.source)
            continue
        except redis.exceptions.ResponseError as exc:  # as a pipeline: each call's error
            return [exc] * len(prepared)
        return [
            answer[1] if answer[0] == 1 and len(answer) > 1
            else None if answer[0] == 1
            else redis.exceptions.ResponseError(_text(answer[1]))
            for answer in answers
        ]  # fmt: skip
    return [missing] * len(prepared)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _run_pipeline(
    r: redis.Redis, script: Any, prepared: list[tuple[list[str], list[Any]]]
) -> list[Any]:
    answers: list[Any] = [None] * len(prepared)
    todo = list(range(len(prepared)))
    for _ in range(2):
        pipe = r.pipeline(transaction=False)
        for i in todo:
            names, args = prepared[i]
            pipe.evalsha(script.sha, len(names), *names, *args)
        for i, answer in zip(todo, pipe.execute(raise_on_error=False), strict=True):
            answers[i] = answer
        todo = [i for i in todo if isinstance(answers[i], redis.exceptions.NoScriptError)]
        if not todo:
            break
        r.script_load(script.script)
    return answers
