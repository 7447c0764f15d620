"""Rollout leases: who runs each rollout now, and the takeover of those whose holder went silent.

A delivery of a rollout takes the rollout's lease before anything else (`take`): holder (this
worker process), attempt token, stage, last heartbeat, and the task message that runs it. One
thread per process renews every lease the process holds, in one round trip per third of the
lease TTL (`ROLLOUTS_LEASE_TTL_S`), with the process's admission slots (`workers/rollout/admission.py`),
and in the same round trip takes over expired leases of the whole cluster: a holder that died,
froze or lost Redis stops renewing, and the first live process to notice publishes the
rollout's task again (`workers/redispatch.py`), with no producer and no person, long before the
broker's visibility timeout. The next delivery takes the lease as
a new attempt; the attempt limit (`keys.shard_starts`) still ends a rollout that kills every
worker running it as `worker_lost`.

Fencing per attempt: the lander refuses records whose attempt is not the rollout's current one
(`keys.shard_attempts`; a takeover replaces it at once, before any new attempt starts), and an
attempt that ends after a takeover counts nothing.

Settling is also how a generation of `rollouts run` or `resume` knows it is done: the attempt
that settles a rollout counts it once toward the generation's `enqueued` (`SETTLE_LUA`), and the
settling that counts the last one hands back the finish task to publish (`Settled.finish`). The
generation's chord is thus two fields of its hash and a bit per rollout, not Celery's chord keys
(a result and a task id per rollout, ~220 bytes, until the callback). A counted settling, and
each renewal, also refill the queue windows (`workers/window.py`): with `queue_window` the
workers publish a run's next rows, not its producer.
A copy of a delivery whose rollout runs elsewhere under a fresh lease (celery/celery#5935: the
Redis transport redelivers a message unacknowledged past its visibility timeout) is acknowledged
without calling the agent and is no death.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import orjson
import redis

from infra import keys
from infra.environment import from_env
from infra.redis_client import client, run_scripts
from infra.scripts import GIVE_BACK_LUA, RENEW_ROLLOUTS_LUA, SETTLE_LUA, TAKE_LEASE_LUA
from workers.finish_ahead import wake_reader
from workers.rollout.admission import with_redis_retry
from workers.shard.landed import settled
from workers.shard.leases import lease_member

log = logging.getLogger(__name__)

SETTLE_RETRY_S = 30.0
"""How long settling a lease rides out a Redis restart."""

FRESH_SHARE = 0.8
"""A lease taken or renewed less than this share of its TTL ago is known to be current without
asking Redis (the rest of the TTL is margin for the round trip and the clocks)."""

CLAIM_BATCH = 64
"""Expired leases one renewal takes over at most; the next renewal takes the rest."""

Stage = Literal["admitted", "calling", "landing"]
"""What a held lease's attempt is doing: waiting for its slot, calling `/run`, landing."""


@dataclass(frozen=True)
class Lease:
    """One attempt's hold on a rollout."""

    sid: str
    key: str
    """`task:rollout`."""
    attempt: str
    """This attempt's token: the lander lands only the current attempt's records."""

    @property
    def number(self) -> int:
        """The attempt's number in its generation (the first is 1; 0 for a delivery without a
        lease): the second half of its records' execution, reserved when the lease was taken."""
        parts = self.attempt.split("/")
        return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else 0

    @property
    def member(self) -> str:
        """Its member of `keys.ROLLOUT_LEASES`."""
        return lease_member(self.sid, self.key)


@dataclass(frozen=True)
class LeaseTicket:
    """The answer to a delivery asking for its rollout's lease."""

    verdict: Literal["taken", "live", "settled"]
    """taken: run it; live: another attempt holds a fresh lease; settled: it ended already."""
    detail: str = ""
    """live: the holder running it."""
    lease: Lease | None = None
    """taken: the lease."""
    lost: str = ""
    """taken: the silent holder it was taken over from, if any."""


@dataclass(frozen=True)
class ReplyPush:
    """A Python API rollout's reply, pushed in the round trip that settles its lease."""

    replies: str
    """The invocation's reply list."""
    body: str
    ttl_s: int
    """The reply list's expiry."""
    active: str
    """The invocation's set of running rollouts, which the reply leaves."""
    index: int


class Refill(Protocol):
    """What refills the queue windows (`workers/window.py`'s `QueueWindow`)."""

    def settled(self, sid: str) -> int: ...

    def tick(self) -> int: ...


@dataclass(frozen=True)
class Settled:
    """What settling an attempt did."""

    counted: bool
    """The attempt settled its rollout (False: it was taken over, or the rollout settled in its
    generation already; its outcome is void)."""
    finish: dict[str, Any] | None = None
    """It settled the generation's last rollout: the finish task's signature, to publish."""


@dataclass(frozen=True)
class TakeCall:
    """One delivery's asking for its rollout's lease, as `LeaseKeeper.take_many` takes it."""

    sid: str
    key: str
    token: str
    message: dict[str, Any]


@dataclass(frozen=True)
class SettleCall:
    """One attempt's settling, as `LeaseKeeper.settle_many` takes it."""

    lease: Lease
    token: str
    count: bool = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RolloutLeases:
    """This process's rollout leases: take, stage, settle, and the renewal and takeover thread."""

    def __init__(
        self,
        redis_url: str,
        publish: Callable[[dict[str, Any]], None] | None = None,
        ttl_s: float | None = None,
        start: bool = True,
        sweep: Callable[[], int] | None = None,
        slots: Callable[[], AbstractContextManager[list[str]]] | None = None,
        window: Refill | None = None,
    ) -> None:
        self.r = client(redis_url)
        self.ttl_s = from_env().lease_ttl_s if ttl_s is None else ttl_s
        self.key_ttl_s = from_env().live_key_ttl_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._publish = publish
        self._sweep = sweep
        """Runs after each renewal: `workers/redispatch.py`'s sweep of unstarted messages."""
        self._slots = slots
        """The admission slots' leases this process holds, renewed in the same round trip
        (`workers/rollout/admission.py`'s renewer, adopted)."""
        self._window = window
        """Refills the queue windows (`workers/window.py`) after each counted settling and renewal."""
        self._take = self.r.register_script(TAKE_LEASE_LUA)
        self._renew = self.r.register_script(RENEW_ROLLOUTS_LUA)
        self._settle = self.r.register_script(SETTLE_LUA)
        self._give_back = self.r.register_script(GIVE_BACK_LUA)
        self._held: dict[str, tuple[str, Stage, float]] = {}
        """Held leases: member -> (attempt, stage, when it was last taken or renewed: the
        monotonic time just before the round trip that did it)."""
        # Held across a renewal, so a lease settled meanwhile is not renewed after its removal.
        self._lock = threading.Lock()
        self.republished = 0
        """Rollouts this process took over and published again."""
        if start:
            threading.Thread(target=self._loop, name="rollouts-rollout-leases", daemon=True).start()

    @staticmethod
    def _keys(sid: str, token: str) -> list[str]:
        return [
            keys.shard_rollout_leases(sid),
            keys.shard_attempts(sid),
            keys.shard_lease_messages(sid),
            keys.shard_settled(sid, token),
            keys.ROLLOUT_LEASES,
        ]

    def take(self, sid: str, key: str, token: str, message: dict[str, Any]) -> LeaseTicket:
        """Take the rollout's lease for a new attempt of generation `token`, unless it runs or ended."""
        call = TakeCall(sid, key, token, message)
        names, args = self._take_script_call(call)
        sent = time.monotonic()
        return self._taken(call, self._take(keys=names, args=args, client=self.r), sent)

    def take_many(self, calls: list[TakeCall]) -> list[LeaseTicket | Exception]:
        """`take` for each of `calls`, in one round trip: the engine gathers the starts of the
        deliveries that arrived together (`Gathered`). A call whose script failed gets its
        error; a Redis error of the round trip raises for all."""
        prepared = [self._take_script_call(call) for call in calls]
        sent = time.monotonic()
        answers = run_scripts(self.r, self._take, prepared)
        return [
            answer if isinstance(answer, Exception) else self._taken(call, answer, sent)
            for call, answer in zip(calls, answers, strict=True)
        ]

    def _take_script_call(self, call: TakeCall) -> tuple[list[str], list[Any]]:
        member = lease_member(call.sid, call.key)
        args: list[Any] = [
            call.key, call.token, self.holder, self.ttl_s, _encoded(call.message), member,
            self.key_ttl_s,
        ]  # fmt: skip
        return self._keys(call.sid, call.token), args

    def _taken(self, call: TakeCall, answer: Any, sent: float) -> LeaseTicket:
        """What TAKE_LEASE_LUA's `answer` says; a lease taken is held (renewed) from `sent`."""
        verdict, detail, lost = (_text(v) for v in answer)
        if verdict != "taken":
            return LeaseTicket(cast(Literal["live", "settled"], verdict), detail)
        lease = Lease(call.sid, call.key, detail)
        with self._lock:
            self._held[lease.member] = (lease.attempt, "admitted", sent)
        if lost:
            log.warning("rollout %s of shard %s taken over from %s, which went silent", call.key,
                        call.sid, lost)  # fmt: skip
        return LeaseTicket("taken", lease=lease, lost=lost)

    def stage(self, lease: Lease, stage: Stage) -> None:
        """Note the attempt's stage; it reaches Redis with the next renewal (no round trip now)."""
        with self._lock:
            held = self._held.get(lease.member)
            if held is not None:
                self._held[lease.member] = (lease.attempt, stage, held[2])

    def fresh(self, lease: Lease) -> bool:
        """Whether this process took or renewed the lease less than most of its TTL ago, so that
        it cannot have expired, nor been taken over, since (no round trip)."""
        with self._lock:
            held = self._held.get(lease.member)
        return (
            held is not None
            and held[0] == lease.attempt
            and (time.monotonic() - held[2] < FRESH_SHARE * self.ttl_s)
        )

    def current(self, lease: Lease, token: str) -> bool:
        """Whether the lease's attempt is still its rollout's current one in generation `token`:
        not taken over, and the rollout not settled by another attempt (or Redis lost both)."""
        now = self.r.hget(keys.shard_attempts(lease.sid), lease.key)
        if now is not None:
            return _text(now) == lease.attempt
        return not settled(self.r, lease.sid, token, lease.key)

    def settle(
        self, lease: Lease, token: str, reply: ReplyPush | None = None, count: bool = False
    ) -> Settled:
        """The attempt ended: drop its lease, the rollout is settled in generation `token` (and
        `reply` pushed, in the same round trip); with `count`, it counts toward the generation's
        finish. Not counted (nothing pushed) if the attempt was taken over (the current attempt
        settles it) or the rollout settled already. A lease whose attempt is '' is a delivery
        that took none: it settles and counts the same way."""
        call = SettleCall(lease, token, count)
        names, args = self._settle_script_call(call, reply)
        # Retried through a Redis restart: a lease left behind would be taken over and its
        # rollout, counted already, counted again.
        answer = with_redis_retry(
            "lease settle",
            lambda: self._settle(keys=names, args=args, client=self.r),
            budget_s=SETTLE_RETRY_S,
        )
        return self._settled(call, answer)

    def settle_many(self, calls: list[SettleCall]) -> list[Settled | Exception]:
        """`settle` for each of `calls` (none pushes a reply), in one round trip: the engine
        gathers the settlings of the rollouts that ended meanwhile (`Gathered`). A call whose
        script failed gets its error; a Redis outage past the retries raises for all."""
        prepared = [self._settle_script_call(call) for call in calls]
        answers = with_redis_retry(
            "lease settle",
            lambda: run_scripts(self.r, self._settle, prepared),
            budget_s=SETTLE_RETRY_S,
        )
        return [
            answer if isinstance(answer, Exception) else self._settled(call, answer)
            for call, answer in zip(calls, answers, strict=True)
        ]

    def _settle_script_call(
        self, call: SettleCall, reply: ReplyPush | None = None
    ) -> tuple[list[str], list[Any]]:
        """SETTLE_LUA's keys and arguments for `call`; the lease stops being renewed."""
        lease = call.lease
        with self._lock:
            self._held.pop(lease.member, None)
        names = [*self._keys(lease.sid, call.token), keys.shard_generation(lease.sid)]
        args: list[Any] = [
            lease.key, lease.attempt, call.token, lease.member, self.key_ttl_s,
            1 if call.count else 0,
        ]  # fmt: skip
        if reply is not None:
            names += [reply.replies, reply.active]
            args += [reply.body, reply.ttl_s, reply.index]
        return names, args

    def _settled(self, call: SettleCall, answer: Any) -> Settled:
        """What SETTLE_LUA's `answer` says; a counted settling refills the shard's queue window."""
        counted, finish = answer
        if counted and call.count and self._window is not None:
            try:
                self._window.settled(call.lease.sid)
            except Exception as exc:  # the next renewal refills it
                log.warning(
                    "could not refill the queue window of shard %s: %r", call.lease.sid, exc
                )
        signature = _text(finish)
        if signature:
            try:  # the generation settled: its reader need not wait for the finish task
                wake_reader(self.r, call.lease.sid, call.token)
            except redis.RedisError as exc:  # the finish task wakes it when it asks
                log.warning("could not wake the reader of shard %s: %r", call.lease.sid, exc)
        return Settled(bool(counted), json.loads(signature) if signature else None)

    def forget(self, lease: Lease) -> None:
        """Stop renewing the lease without settling it (Redis could not be reached to settle)."""
        with self._lock:
            self._held.pop(lease.member, None)

    def give_back(self, lease: Lease) -> None:
        """Drop the lease of an attempt that never started (its worker stops before the delivery
        got a slot), settling nothing: the next delivery of the rollout takes it at once."""
        with self._lock:
            self._held.pop(lease.member, None)
        names = [keys.shard_rollout_leases(lease.sid), keys.shard_attempts(lease.sid),
                 keys.shard_lease_messages(lease.sid), keys.ROLLOUT_LEASES]  # fmt: skip
        try:
            self._give_back(
                keys=names, args=[lease.key, lease.attempt, lease.member], client=self.r
            )
        except redis.RedisError as exc:  # it expires and is taken over instead
            log.warning("could not give the lease of %s back: %s", lease.member, exc)

    def renew_once(self) -> int:
        """Renew the held leases and take over expired ones; returns how many were published again."""
        slots = self._slots() if self._slots is not None else contextlib.nullcontext([])
        with self._lock, slots as held_slots:
            args: list[str | int | float] = [
                self.ttl_s,
                CLAIM_BATCH if self._publish is not None else 0,
                self.holder,
                keys.ROLLOUT_LEASE_KEY,
                keys.ROLLOUT_MESSAGE_KEY,
                keys.ROLLOUT_ATTEMPTS_KEY,
                self.key_ttl_s,
                len(held_slots) // 2,
                *held_slots,
            ]
            for member, (attempt, stage, _) in self._held.items():
                args += [member, attempt, stage]
            sent = time.monotonic()
            try:
                gone, taken = self._renew(keys=[keys.ROLLOUT_LEASES], args=args, client=self.r)
            except redis.RedisError as exc:
                log.warning("could not renew %d rollout leases: %s", len(self._held), exc)
                return 0
            for member, (attempt, stage, _) in list(self._held.items()):
                self._held[member] = (attempt, stage, sent)
            for member in gone:
                # Taken over while this process was silent: its outcome will be refused.
                if self._held.pop(_text(member), None) is not None:
                    log.warning("lost the lease of %s: another attempt runs it", _text(member))
        published = 0
        for member, message in taken:
            published += self._republish(_text(member), json.loads(_text(message)))
        return published

    def _republish(self, member: str, message: dict[str, Any]) -> int:
        assert self._publish is not None
        try:
            self._publish(message)
        except Exception as exc:  # the lease expires again and is taken over again
            log.warning("could not publish %s again: %r", member, exc)
            return 0
        log.warning("rollout %s: its holder went silent; published it again", member)
        self.republished += 1
        return 1

    def _loop(self) -> None:
        while True:
            time.sleep(self.ttl_s / 3)
            try:
                self.renew_once()
                if self._sweep is not None:
                    self.republished += self._sweep()
                if self._window is not None:
                    self._window.tick()
            except Exception:  # the thread must outlive anything one round trip does
                log.exception("rollout lease renewal failed")


def _encoded(message: dict[str, Any]) -> bytes | str:
    """The task message as JSON: by orjson (the stdlib's encoder took 7% of a rollout's start
    in py-spy), by the stdlib where orjson refuses it (an integer past 64 bits)."""
    try:
        return orjson.dumps(message)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(message)
