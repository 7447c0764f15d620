"""Whether a rollout may start now: stop flags, fencing, the dispatch budget, cluster-wide caps.

One Lua call per rollout decides it (`begin`), one more returns the slot (`end`); a 429/503
reply returns it early (`back_off`) while the rollout waits. Each agent's concurrent calls are
also bounded by its adaptive window (`keys.agent_window`), one for the whole cluster: an agent
that declares `max_concurrency` starts there, one that declares none slow-starts from
`INITIAL_WINDOW` (doubling per round trip, or per `SLOW_START_PROBE_S` of a full window),
shrunk by `WINDOW_DECREASE` on a 429/503 at most once per round trip, grown on success, up to the
agent's `max_concurrency` (else the run's `max_resident_tasks`, else `DEFAULT_WINDOW_CAP`). A slot is a
*lease*: a member of a Redis sorted set scored by its expiry on the Redis server's clock. Each
worker process renews the leases it holds from one thread; a process that dies stops renewing,
and its slots come back when the leases expire, with nobody cleaning up. The same sorted sets
give `rollouts status` its in-flight counts.

The begin call also counts deliveries that started and never finished (`keys.shard_starts`): a
rollout that workers died on more times than the attempt limit becomes a `worker_lost` failure
instead of being delivered forever.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
from celery.signals import worker_shutdown

from infra import generation, keys
from infra.environment import from_env
from infra.process import PerProcess
from infra.redis_client import client, run_scripts
from infra.scripts import BACK_OFF_LUA, BEGIN_LUA, END_LUA, RENEW_LUA
from infra.slots import slot_agent, slot_member
from schemas import fields as F
from schemas.messages import CollectRequest
from schemas.outcomes import Admit
from workers.tracing import step

log = logging.getLogger(__name__)

T = TypeVar("T")

STARTS_KEEP_S = 7 * 24 * 3600
DURATIONS_KEPT = 1000
MARGIN_REFRESH_S = 2.0
FLAGS_REFRESH_S = 0.5
WAIT_MIN_S, WAIT_MAX_S = 0.02, 0.25
REDIS_RETRY_S = 120.0

RELEASE_BATCH = 256

INITIAL_WINDOW = 10
"""The window of an agent that declares no max_concurrency, before its first success (TCP's
initial window, RFC 6928): a cold server is not stormed by the first burst."""
DEFAULT_WINDOW_CAP = 65536
"""The largest window of an agent with no max_concurrency, in a run with no max_resident_tasks
(well above an RL step's 8,192 rollouts at once: the cluster's slots bound it first)."""
SLOW_START_PROBE_S = 0.25
"""In slow start, a full window that has gone this long with no 429/503 doubles (as well as
growing by one per success): a round trip to an agent is a whole rollout, seconds to an hour,
while a rate limiter answers at once."""
WINDOW_KEEP_S = 3600
"""An agent's window unused this long is forgotten, e.g. after its workers died (an agent left
idle forgets it at once: the end script)."""
WINDOW_DECREASE = 0.7
"""A 429/503 shrinks the window to this fraction (CUBIC's beta: a shallower saw than halving
keeps more of a rate-limited agent's capacity in use)."""
LIMITED_KEEP_S = 60.0
"""How far back the 429/503 counter of `rollouts status` looks."""


@dataclass
class Ticket:
    """The begin call's verdict for one delivery of a rollout."""

    verdict: Admit
    """run, or why it must not start: duplicate, fenced, drained, stopped or worker_lost."""
    detail: str
    """stopped: the stop reason as `stop_reason` words it (`failed: ...`, `cancel`, `drain`);
    drained: the seconds left in the budget; worker_lost: the earlier unfinished deliveries;
    fenced: the opener token that fenced it."""
    sid: str
    key: str
    member: str
    agent_key: str
    agent_url: str = ""


@dataclass(frozen=True)
class AdmitCall:
    """One try at admission (`Gate.try_admit_many`): as `Gate.try_admit` takes it."""

    req: CollectRequest
    sid: str
    readmit: Ticket | None = None
    waiting: Ticket | None = None


@dataclass(frozen=True)
class _BeginCall:
    """BEGIN_LUA's keys and arguments for one try, and what its ticket is made of."""

    keys: list[str]
    args: list[str | int | float]
    sid: str
    key: str
    member: str
    agent_url: str


def with_redis_retry(what: str, fn: Callable[[], T], budget_s: float = REDIS_RETRY_S) -> T:
    """Call `fn`, retrying connection errors with backoff for up to `budget_s` (Redis restarting)."""
    deadline = time.monotonic() + budget_s
    delay = 0.2
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def p75(values: list[float]) -> float:
    """The 75th percentile by linear interpolation between closest ranks."""
    ordered = sorted(values)
    pos = 0.75 * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _LeaseRenewer:
    """Renews every lease this process holds, from one thread, every third of the lease time.

    In a worker process the rollout leases' thread adopts it (`adopt`): both kinds of lease are
    then renewed in one round trip per interval (`workers/rollout/leases.py`), and this thread idles.
    """

    def __init__(self, r: redis.Redis, script: Any, ttl_s: float) -> None:
        self._r = r
        self._script = script
        self._ttl_s = ttl_s
        self._held: dict[str, tuple[str, ...]] = {}
        # Held across a renewal's Redis call, so a lease removed here is never renewed (re-added)
        # by a renewal that read it before the removal.
        self._lock = threading.Lock()
        self._adopted = False
        self._thread = threading.Thread(target=self._loop, name="rollouts-leases", daemon=True)
        self._thread.start()

    def adopt(self, ttl_s: float) -> Callable[[], AbstractContextManager[list[str]]] | None:
        """Hand the renewal to another thread renewing every third of `ttl_s`: returns what it
        enters for each renewal (`held`), or None if the intervals differ (this thread keeps
        renewing)."""
        if ttl_s != self._ttl_s:
            return None
        self._adopted = True
        return self.held

    @contextlib.contextmanager
    def held(self) -> Iterator[list[str]]:
        """The held leases as flat (lease set, member) pairs, under the lock for the duration of
        the adopting thread's renewal."""
        with self._lock:
            yield [x for pair in self._pairs() for x in pair]

    def add(self, member: str, zsets: tuple[str, ...]) -> None:
        with self._lock:
            self._held[member] = zsets

    def remove(self, member: str) -> None:
        with self._lock:
            self._held.pop(member, None)

    def renew_once(self) -> int:
        """Push every held lease's expiry forward (re-adding it if Redis lost it); returns how many."""
        with self._lock:
            if not self._held:
                return 0
            zsets, members = self._renewal()
            try:
                self._script(keys=zsets, args=members, client=self._r)
            except redis.RedisError as exc:
                log.warning("could not renew %d leases: %s", len(self._held), exc)
                return 0
            return len(self._held)

    def _pairs(self) -> list[tuple[str, str]]:
        """(lease set, member) per held lease and set it is in (under the lock)."""
        return [(k, member) for member, keys_ in self._held.items() for k in keys_]

    def _renewal(self) -> tuple[list[str], list[str]]:
        """RENEW_LUA's keys and arguments for the held leases (under the lock)."""
        pairs = self._pairs()
        zsets = [k for k, _ in pairs]
        members = [str(self._ttl_s), str(from_env().live_key_ttl_s), *(m for _, m in pairs)]
        return zsets, members

    def _loop(self) -> None:
        while True:
            time.sleep(self._ttl_s / 3)
            if not self._adopted:
                self.renew_once()


Release = tuple[str, tuple[str, ...], list[str | float]]
"""A release as `_Releaser.put` queues it: the slot's member, its keys, its arguments."""


def release_call(batch: list[Release]) -> tuple[list[str], list[str | float]]:
    """The KEYS and ARGV of `END_LUA` for `batch`: each group of keys once (a batch's releases
    share a few: a shard's and an agent's), each release its group's index and its arguments."""
    groups: dict[tuple[str, ...], int] = {}
    call_keys: list[str] = []
    args: list[str | float] = [DURATIONS_KEPT, from_env().live_key_ttl_s]
    for _, zkeys, item_args in batch:
        group = groups.get(zkeys)
        if group is None:
            group = groups[zkeys] = len(groups)
            call_keys.extend(zkeys)
        args.append(group)
        args.extend(item_args)
    return call_keys, args


class _Releaser:
    """Returns slots from one thread, many per Lua call: a task does not wait for its release,
    and `put` never blocks (the event loop calls it).

    A released slot stops being renewed here, before its release is sent (`forget`: the
    renewer's lock is held across a renewal's round trip, which the caller must not wait on),
    so no renewal re-adds it after. A release lost with its process only delays the slot (its
    lease expires) and leaves its delivery counted as unfinished, which no harm comes from below
    the attempt limit.
    """

    def __init__(self, r: redis.Redis, script: Any, forget: Callable[[str], None]) -> None:
        self._r = r
        self._script = script
        self._forget = forget
        self._queue: queue.SimpleQueue[Release] = queue.SimpleQueue()
        self._pending = 0
        """Releases queued and not sent yet (under `_lock`: a bare lock, which `put` takes on the
        event loop once per rollout; a `Condition`'s Python-level enter and exit cost more)."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rollouts-release", daemon=True)
        self._thread.start()

    def put(self, member: str, zkeys: tuple[str, ...], args: list[str | float]) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((member, zkeys, args))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued release was sent to Redis (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < RELEASE_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for member, _, _ in batch:
                self._forget(member)
            call_keys, args = release_call(batch)
            try:
                with_redis_retry(
                    "lease release",
                    functools.partial(self._script, keys=call_keys, args=args, client=self._r),
                    budget_s=30.0,
                )
            except redis.RedisError as exc:
                log.warning(
                    "could not release %d leases (they expire by themselves): %s", len(batch), exc
                )
            with self._lock:
                self._pending -= len(batch)


class AdmissionWaits:
    """The pauses between a waiting rollout's tries: jittered, growing from `WAIT_MIN_S` to
    `WAIT_MAX_S`."""

    def __init__(self, max_s: float = WAIT_MAX_S) -> None:
        self._delay = WAIT_MIN_S
        self._max_s = max_s

    def next_s(self) -> float:
        wait_s = random.uniform(self._delay / 2, self._delay)
        self._delay = min(self._delay * 1.5, self._max_s)
        return wait_s


class Gate:
    """This process's admission: begin/end calls, lease renewal, cached stop flags and margins."""

    def __init__(self, redis_url: str, ttl_s: float | None = None) -> None:
        self.pid = os.getpid()
        self.r = client(redis_url)
        self._begin = self.r.register_script(BEGIN_LUA)
        self._back_off = self.r.register_script(BACK_OFF_LUA)
        self.ttl_s = from_env().lease_ttl_s if ttl_s is None else ttl_s
        self.renewer = _LeaseRenewer(self.r, self.r.register_script(RENEW_LUA), self.ttl_s)
        self.releaser = _Releaser(self.r, self.r.register_script(END_LUA), self.renewer.remove)
        self._holder = f"{socket.gethostname()}:{self.pid}"
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._flags: dict[str, tuple[float, str | None]] = {}
        self._margins: dict[str, tuple[float, float | None]] = {}
        self._keys: dict[tuple[str, str], list[str]] = {}

    def _member(self, agent: str, key: str) -> str:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        return slot_member(self._holder, seq, agent, key)

    def _begin_keys(self, sid: str, agent_url: str) -> list[str]:
        found = self._keys.get((sid, agent_url))
        if found is None:
            if len(self._keys) > 10_000:  # a long-lived worker of many runs
                self._keys.clear()
            found = self._keys[(sid, agent_url)] = [
                keys.shard_state(sid),
                keys.shard_landed(sid),
                keys.shard_run_failed(sid),
                keys.shard_cancel(sid),
                keys.shard_generation(sid),
                keys.shard_counts(sid),
                keys.shard_starts(sid),
                keys.shard_leases(sid),
                keys.shard_waiting(sid),
                keys.agent_leases(agent_url),
                keys.agent_window(agent_url),
                keys.agent_waiting(agent_url),
            ]
        return found

    def margin_s(self, sid: str, req: CollectRequest) -> float | None:
        """The drain margin: explicit, else the p75 of this run's successful durations once there are 5."""
        adm = req.admission
        if adm.drain_margin_s is not None:
            return adm.drain_margin_s
        now = time.monotonic()
        cached = self._margins.get(sid)
        if cached is not None and now - cached[0] < MARGIN_REFRESH_S:
            return cached[1]
        raw: list[bytes] = self.r.lrange(keys.shard_durations(sid), 0, -1)  # type: ignore[assignment]
        values = [float(v) for v in raw]
        margin = p75(values) if len(values) >= 5 else None
        self._margins[sid] = (now, margin)
        return margin

    def admit(self, req: CollectRequest, sid: str, readmit: Ticket | None = None) -> Ticket:
        """Wait for a slot and take it, or say why the rollout must not start (blocking; the
        rollout engine waits on its event loop instead, between `try_admit`s)."""
        waits = AdmissionWaits()
        ticket = self.try_admit(req, sid, readmit)
        while ticket.verdict == "wait":
            time.sleep(waits.next_s())
            ticket = self.try_admit(req, sid, readmit, waiting=ticket)
        return ticket

    def try_admit(
        self,
        req: CollectRequest,
        sid: str,
        readmit: Ticket | None = None,
        waiting: Ticket | None = None,
    ) -> Ticket:
        """Take a slot, or say why the rollout must not start; `wait` while the caps are full
        (the rollout is listed as waiting; try again within `WAIT_MAX_S`, with `waiting`).

        `readmit`: the delivery's ticket before its rate-limit wait; it keeps its start (and
        its lease member, which the wait listed as waiting for the agent).
        """
        with step("rollouts.admission_wait") as traced:
            ticket = self._admit(req, sid, readmit, waiting)
            traced.set("rollouts.readmit", readmit is not None)
            traced.set("rollouts.admission.verdict", ticket.verdict)
            return ticket

    def try_admit_many(self, calls: list[AdmitCall]) -> list[Ticket | Exception]:
        """`try_admit` for each of `calls`, in one round trip: the engine gathers the admissions
        of the deliveries that start together (`Gathered`), and opens each one's admission span
        itself. A call whose script failed gets its error in its place; a Redis error of the
        round trip raises for all."""
        prepared = [self._prepare(c.req, c.sid, c.readmit, c.waiting) for c in calls]
        scripts = [(p.keys, p.args) for p in prepared]
        answers = with_redis_retry("admission", lambda: run_scripts(self.r, self._begin, scripts))
        return [
            answer if isinstance(answer, Exception) else self._ticket(p, answer)
            for p, answer in zip(prepared, answers, strict=True)
        ]

    def _admit(
        self, req: CollectRequest, sid: str, readmit: Ticket | None, waiting: Ticket | None
    ) -> Ticket:
        p = self._prepare(req, sid, readmit, waiting)
        answer = with_redis_retry(
            "admission", lambda: self._begin(keys=p.keys, args=p.args, client=self.r)
        )
        return self._ticket(p, answer)

    def _prepare(
        self, req: CollectRequest, sid: str, readmit: Ticket | None, waiting: Ticket | None
    ) -> _BeginCall:
        """BEGIN_LUA's keys and arguments for one try (reading the drain margin if need be)."""
        row = req.row
        key = f"{row[F.TASK_INDEX]}:{row[F.ROLLOUT_INDEX]}"
        agent = F.dispatch_target(row) or ""
        listed = readmit or waiting
        member = listed.member if listed is not None else self._member(agent, key)
        call_keys = self._begin_keys(sid, req.agent_url)
        adm = req.admission
        margin = None
        if adm.dispatch_deadline is not None:
            margin = with_redis_retry("drain margin", lambda: self.margin_s(sid, req))
        args: list[str | int | float] = [
            req.run.token,
            key,
            member,
            self.ttl_s,
            adm.max_resident_tasks or 0,
            adm.agent_max_concurrency or 0,
            req.policy.max_attempts,
            adm.dispatch_deadline or 0,
            -1 if margin is None else margin,
            STARTS_KEEP_S,
            0 if readmit is None else 1,
            DEFAULT_WINDOW_CAP,
            INITIAL_WINDOW,
            WINDOW_KEEP_S,
            from_env().live_key_ttl_s,
            SLOW_START_PROBE_S,
        ]
        return _BeginCall(call_keys, args, sid, key, member, req.agent_url)

    def _ticket(self, p: _BeginCall, answer: Any) -> Ticket:
        """The ticket BEGIN_LUA's `answer` gives; a slot taken is renewed from now on."""
        word, detail = (v.decode() if isinstance(v, bytes) else str(v) for v in answer)
        # `wait`: the caps are full; the waiting entry expires unless a next try re-adds it.
        verdict = cast(Admit, word)
        agent_key, leases = p.keys[9], p.keys[7]
        ticket = Ticket(verdict, detail, p.sid, p.key, p.member, agent_key, p.agent_url)
        if verdict == "run":
            self.renewer.add(p.member, (leases, agent_key))
        return ticket

    def free_slot(self, ticket: Ticket, token: str, ok: bool = False) -> None:
        """Give the slot back as soon as the `/run` call ended, before the records land; `ok`
        (the call succeeded) grows the agent's window. Never blocks."""
        self.releaser.put(
            ticket.member,
            self._release_keys(ticket),
            [ticket.member, "", token, "", -1, "1" if ok else "0"],
        )

    def back_off(self, ticket: Ticket, status: int, wait_s: float | None, call_s: float) -> None:
        """A 429/503 reply: give the slot back now, count it, and shrink the agent's window (at
        most once per round trip); `wait_s` is the wait that follows, None if the rollout gave up."""
        self.renewer.remove(ticket.member)
        url = ticket.agent_url
        agent = slot_agent(ticket.member)
        call_keys = [
            keys.shard_leases(ticket.sid),
            ticket.agent_key,
            keys.agent_window(url),
            keys.agent_limited(url),
            keys.agent_waiting(url),
            keys.shard_counts(ticket.sid),
            keys.shard_waiting(ticket.sid),
        ]
        args: list[str | float] = [
            ticket.member,
            call_s,
            -1 if wait_s is None else wait_s,
            agent,
            self.ttl_s,
            INITIAL_WINDOW,
            WINDOW_KEEP_S,
            LIMITED_KEEP_S,
            WINDOW_DECREASE,
            from_env().live_key_ttl_s,
        ]
        try:
            with_redis_retry(
                "rate-limit back-off",
                lambda: self._back_off(keys=call_keys, args=args, client=self.r),
                budget_s=30.0,
            )
        except redis.RedisError as exc:
            # The lease expires by itself; the window misses one decrease.
            log.warning("could not record a %d reply of %s: %s", status, url, exc)

    def release(
        self,
        ticket: Ticket,
        token: str,
        field: str = generation.DONE,
        duration_s: float | None = None,
    ) -> None:
        """Give the slot back (if still held) and count the outcome, batched with other releases.
        Never blocks: the event loop calls it."""
        duration: str | float = -1 if duration_s is None else duration_s
        self.releaser.put(
            ticket.member,
            self._release_keys(ticket),
            [ticket.member, ticket.key, token, field, duration, "0"],
        )

    @staticmethod
    def _release_keys(ticket: Ticket) -> tuple[str, ...]:
        return (
            keys.shard_leases(ticket.sid),
            ticket.agent_key,
            keys.shard_starts(ticket.sid),
            keys.shard_generation(ticket.sid),
            keys.shard_durations(ticket.sid),
            keys.agent_window(ticket.agent_url),
            keys.agent_waiting(ticket.agent_url),
        )  # fmt: skip

    def fail_run(self, sid: str, message: str) -> None:
        """Flag the run failed with its first error: nothing new starts after it."""
        with_redis_retry(
            "run failure flag",
            lambda: self.r.set(
                keys.shard_run_failed(sid), message, nx=True, ex=from_env().live_key_ttl_s
            ),
        )

    def stop_reason(self, sid: str) -> str | None:
        """`failed: ...`, `cancel` or `drain` when the run was stopped; read at most every half second."""
        now = time.monotonic()
        cached = self._flags.get(sid)
        if cached is not None and now - cached[0] < FLAGS_REFRESH_S:
            return cached[1]
        try:
            failed, cancel = self.r.mget(keys.shard_run_failed(sid), keys.shard_cancel(sid))
        except redis.RedisError:
            return cached[1] if cached is not None else None
        reason = None
        if isinstance(failed, bytes):
            reason = f"failed: {failed.decode()}"
        elif isinstance(cancel, bytes):
            reason = cancel.decode()
        self._flags[sid] = (now, reason)
        return reason


_gates: PerProcess[str, Gate] = PerProcess(Gate)


def gate(redis_url: str) -> Gate:
    """This process's gate for the Redis at `redis_url`, created on first use (after any fork)."""
    return _gates.get(redis_url)


def _flush_releases(**_: Any) -> None:
    """A worker that stops on purpose hands back its slots at once rather than by expiry."""
    for found in _gates.existing():
        found.releaser.flush(5.0)


worker_shutdown.connect(_flush_releases, weak=False)
