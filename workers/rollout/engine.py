"""One rollout, start to finish: admit it, call `/run`, sort the outcome, land it, release its slot.

A 429/503 reply loops back before the sort: the slot is given back (`back_off`), the rollout
waits (`workers/rollout/backpressure.py`), and it is admitted again, keeping its start and its attempt.

A delivery that carries its task message (a run's or the Python API's) first takes its rollout's lease
(`workers/rollout/leases.py`): a copy of a delivery whose rollout runs elsewhere, or settled already,
ends there (`REDELIVERED`); the lease's attempt token fences what lands; and an attempt whose
lease was taken over while it was silent ends `TAKEN_OVER`, counting nothing.

A rollout is a coroutine (`run_rollout_async`) on its worker process's event loop: the `/run`
call runs there, and each blocking step (a Redis round trip of the gate or the leases, the
manifest check, reading the model-call capture) goes to the context's few shared threads
(`RolloutContext.blocking`), grouped so that a rollout makes a handful of such hops. What does
not block (sorting a reply, encoding its records and queueing them for the lander) runs on the
loop as soon as the reply is parsed.
The rollout pool (`workers/pool.py`) runs each delivered message as such a coroutine; a pool
thread (the threads or solo pool) runs one through `run_rollout` and waits for it.

Both rollout tasks are thin adapters over the engine: the collect task of `rollouts run` and
`resume` (`workers/tasks.py`) and the Python API's reply task (`workers/replies.py`).
Nothing here raises for a rollout's own trouble (a task that raised would never count toward
its generation's finish): every path returns a `RolloutOutcome`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis

from infra import generation, keys
from infra.backoff import next_wait_s
from schemas import fields as F
from schemas.errors import ShardFencedError, StorageError, TransientError
from schemas.health import RolloutVerdict
from schemas.messages import CollectRequest
from schemas.outcomes import (
    FAILURE_ENDS,
    RESULT_ENDS,
    VOID_ENDS,
    Ended,
    RolloutOutcome,
    run_failure_message,
)
from workers import tracing
from workers.capture import clear_for, merge_into
from workers.health.live import judge
from workers.rollout.admission import AdmissionWaits, AdmitCall, Ticket
from workers.rollout.agent_call import CallOutcome, stamp_failure_records, with_attempt
from workers.rollout.backpressure import RateLimitWaits, budget_failure
from workers.rollout.context import (
    CALL_ENDED,
    FIRST_WAIT_MAX_S,
    SLOT,
    STALE,
    STOP_POLL_S,
    LeaseKeeper,
    RolloutContext,
)
from workers.rollout.encoding import EncodedRecords
from workers.rollout.landing import LandReport
from workers.rollout.leases import (
    Lease,
    ReplyPush,
    SettleCall,
    Settled,
    Stage,
    TakeCall,
)
from workers.rollout.rows import (
    drained_row,
    not_started_message,
    sort_outcome,
    stamp_execution,
    stamp_timing,
    worker_lost_row,
)
from workers.shard.state import key_str

log = logging.getLogger(__name__)

FEED_POLL_S = 0.5
"""How often a rollout waiting for room in its feed asks again (`max_unconsumed_groups`)."""

LAND_RETRY_S = 120.0
Queued = concurrent.futures.Future[LandReport] | Exception
"""A landing queued with the lander (its future), or what queueing it raised."""
"""How long landing rides out a Redis restart or a busy lock before the rollout ends in error."""


@dataclass(frozen=True)
class Delivery:
    """What the task running this delivery wants beyond the request itself."""

    record: bool = True
    """Land the records in the shard; off for an unrecorded Python API call (the caller owns them)."""
    fails_run: bool = True
    """A final failure flags the run failed unless failures are routed to the sidecar; off for the
    Python API, whose caller decides."""
    admission: CollectRequest | None = None
    """The request admission sees, when it is not the request itself (the Python API keys
    unrecorded rows by their index in the call)."""
    on_admitted: Callable[[], None] | None = None
    """Called once the rollout was admitted, before `/run` is called."""
    message: dict[str, Any] | None = None
    """The task message of this delivery (`workers/redispatch.py`): kept with the rollout's
    lease, for a takeover to publish again. None: the delivery takes no lease."""
    finish: Callable[[dict[str, Any]], None] | None = None
    """A rollout of `rollouts run` or `resume`: its settling counts it toward its generation's
    finish, and this publishes the finish task (its signature) when it counted the last one.
    None: the rollout counts toward no finish (the Python API's)."""
    returns_record: bool = True
    """The outcome carries the `/run` result (the Python API replies with it). Off for a task
    that returns a summary (`rollouts run`'s): the parsed result, often the largest thing a
    rollout holds, is let go once its records are encoded and queued, instead of waiting with
    the rollout for its landing, its settling and the tracer."""
    settle_later: Callable[[Settling], None] | None = None
    """Takes the settling of the lease of an attempt that ended as its rollout's current one, to
    call with `reply` (the Python API's task: the reply goes with the settling, in one round
    trip). None: the lease is settled when the attempt ends."""


@dataclass(frozen=True)
class Settling:
    """The pending settling of an attempt's lease (`Delivery.settle_later`)."""

    leases: LeaseKeeper
    lease: Lease
    token: str

    def reply(self, push: ReplyPush) -> bool:
        """Settle the lease and push `push` in one round trip; False (nothing pushed) if the
        attempt was taken over meanwhile."""
        return self.leases.settle(self.lease, self.token, push).counted

    def forget(self) -> None:
        """Let the lease go unsettled: it expires and is taken over, and another attempt settles it."""
        self.leases.forget(self.lease)


RECORDED = Delivery()
"""A recorded rollout that takes no lease and counts toward no finish (tests, a task sent by
hand)."""


async def run_rollout_async(
    req: CollectRequest, ctx: RolloutContext, delivery: Delivery = RECORDED
) -> RolloutOutcome:
    """Run one delivery of one rollout and return how it ended; never raises for its trouble."""
    try:
        return await _Run(req, ctx, delivery).run()
    except Exception as exc:
        return unexpected(F.rollout_id(req.row), exc)


def run_rollout(
    req: CollectRequest, ctx: RolloutContext, delivery: Delivery = RECORDED
) -> RolloutOutcome:
    """`run_rollout_async` on the context's event loop, from a thread that waits for it."""
    return ctx.loop.run(run_rollout_async(req, ctx, delivery))


def unexpected(rollout: str | None, exc: Exception) -> RolloutOutcome:
    """The rollout is left without an outcome (a resume runs it) and the error is logged."""
    log.exception("rollout %s: unexpected error", rollout)
    return RolloutOutcome(rollout=rollout, ended=Ended.ERROR, detail=f"{type(exc).__name__}: {exc}")


class _Run:
    """The steps of one delivery, sharing its request, context and shard id."""

    def __init__(self, req: CollectRequest, ctx: RolloutContext, delivery: Delivery) -> None:
        self.req = req
        self.ctx = ctx
        self.delivery = delivery
        self.rollout = F.rollout_id(req.row)
        self.sid = keys.shard_id(req.run.output_dir, req.run.shard)
        self.land_error: str | None = None
        self.not_stored: dict[str, Any] | None = None
        """The `result_not_stored` row stored in place of the rollout's last record, if any."""
        self.lease: Lease | None = None
        """This attempt's lease of the rollout, when the delivery takes one."""
        self.encoded: EncodedRecords | None = None
        """The records as they land, once encoded (`queue_landing`)."""
        self.call_ended = CALL_ENDED.get()
        """The pool's slot of this delivery, given back once `/run` ended (`CALL_ENDED`)."""
        self.line = (self.sid, req.agent_url)
        """Its line of rollouts waiting for a slot in this process (`WaitingLines`)."""
        self.verdict: RolloutVerdict | None = None
        """The result's live verdict (`workers/health/live.py`), when it is judged."""
        self.policy_version: int | None = None
        """The feed's policy version the rollout was admitted to call its agent under, stamped on
        its records."""
        self.reruns = 0
        """How many times its call ended stale and it was run again (`rerun_stale`)."""
        self.cut: int | None = None
        """The feed's version that cut its last call for being stale (`agent_call`)."""

    def end(self, ended: Ended, **fields: Any) -> RolloutOutcome:
        return RolloutOutcome(rollout=self.rollout, ended=ended, **fields)

    async def run(self) -> RolloutOutcome:
        """Take the lease, run the attempt, settle the lease."""
        try:
            await self.feed_room()
            opened = await self.start()
            if isinstance(opened, Ticket) and opened.verdict == "wait":
                opened = await self.admitted(None, opened)
            outcome = opened if isinstance(opened, RolloutOutcome) else await self.attempt(opened)
        except Exception as exc:
            outcome = unexpected(self.rollout, exc)
        lease = self.lease
        if lease is None:
            if self.delivery.finish is None or outcome.ended in VOID_ENDS:
                return outcome
            if self.ctx.leases is None or self.delivery.message is None:
                return outcome
            # It took no lease (Redis was away): it still counts toward the finish, once.
            seen = self.delivery.admission or self.req
            lease = Lease(self.sid, key_str(seen.row), "")
        return await self.settle(lease, outcome)

    async def feed_room(self) -> None:
        """Wait, holding nothing, while the rollout's feed holds its bound of unconsumed groups
        (`max_unconsumed_groups`), and note the feed's policy version it starts under; a Redis
        error ends the wait (admission rides it out)."""
        feed, feeds = self.req.feed, self.ctx.feeds
        if feed is None or feeds is None:
            return
        try:
            while True:
                room = await self.ctx.blocking(lambda: feeds.room(feed, self.sid))
                self.policy_version = room.policy_version
                if not room.full:
                    return
                await self.ctx.sleep(FEED_POLL_S)
        except redis.RedisError as exc:
            log.warning("rollout %s: feed %s unreadable (%s); starting", self.rollout, feed.name,
                        exc)  # fmt: skip

    async def start(self) -> RolloutOutcome | Ticket:
        """The lease (`take_lease`), then the manifest check and the first admission (`begin`).
        The lease and the admission are each gathered with those of the deliveries that start
        meanwhile, and they and the manifest check (a hop only until the run is vouched for) go
        ahead of other steps in the step threads' queue: a start waits behind no landing or
        settling.

        A delivery taken ahead of its worker's slots (`SLOT`) waits for its slot on the loop
        between the two, leased.
        """
        taken = await self.take_lease()
        if taken is not None:
            return taken
        slot = SLOT.get()
        if slot is not None:
            if not await slot():
                return await self.ctx.blocking(self.not_started)
            lease, leases = self.lease, self.ctx.leases
            if lease is not None and leases is not None and not leases.fresh(lease):
                over = await self.ctx.blocking(self.taken_over_meanwhile, first=True)
                if over is not None:
                    return over
        return await self.begin()

    def taken_over_meanwhile(self) -> RolloutOutcome | None:
        """For a delivery that waited for its slot while its worker was silent for most of the
        lease TTL (frozen, cut off): how it ends if its lease was taken over meanwhile (the
        rollout runs elsewhere; it calls nothing and ends as the attempt taken over it is);
        blocking."""
        lease, leases = self.lease, self.ctx.leases
        assert lease is not None and leases is not None
        try:
            current = leases.current(lease, self.req.run.token)
        except redis.RedisError:
            current = True  # admission retries Redis; landing fences a stale attempt
        if not current:
            return self.end(Ended.TAKEN_OVER, detail="taken over while it waited for a slot")
        return None

    def not_started(self) -> RolloutOutcome:
        """A delivery refused its slot (the worker stops): its lease goes back at once, and the
        broker gives its message, unacknowledged, to another worker."""
        if self.lease is not None and self.ctx.leases is not None:
            self.ctx.leases.give_back(self.lease)
            self.lease = None
        return self.end(Ended.REDELIVERED, detail="not started: the worker is stopping")

    async def begin(self) -> RolloutOutcome | Ticket:
        """Its run fields vouched for, its capture cleared and its first try at admission; the
        slot's ticket (`wait` while the caps are full), or how the delivery ended. A hop off the
        loop only when there is something to read or clear (the manifest not yet vouched for in
        this process, a capture)."""
        try:
            ctx, req = self.ctx, self.req
            runs = ctx.runs if self.delivery.record else None
            if req.capture is not None or (
                runs is not None and not runs.vouched(req.run, req.agent_url)
            ):
                refused = await ctx.blocking(self.vouch, first=True)
                if refused is not None:
                    return refused
            return await self.admit(None, None)
        except Exception as exc:
            # The lease taken above is settled by `run`, whatever happened here.
            return unexpected(self.rollout, exc)

    def vouch(self) -> RolloutOutcome | None:
        """Check the run fields against the shard's manifest and clear the capture (blocking);
        how the delivery ends when they are refused."""
        ctx = self.ctx
        if self.delivery.record and ctx.runs is not None:
            refused = ctx.runs.refusal(self.req.run, self.req.agent_url)
            if refused is not None:
                log.error("rollout %s refused: %s", self.rollout, refused)
                return self.end(Ended.FENCED, detail=refused)
        clear_for(self.req)  # before dispatch: no attempt reads an earlier delivery's calls
        return None

    async def take_lease(self) -> RolloutOutcome | None:
        """Take the rollout's lease (setting `self.lease`) in one round trip with those of the
        deliveries that start meanwhile (a claim's batch arrives together); or how a copy of a
        delivery ends."""
        takes, message = self.ctx.takes, self.delivery.message
        if takes is None or message is None:
            return None
        seen = self.delivery.admission or self.req
        try:
            ticket = await takes(TakeCall(self.sid, key_str(seen.row), self.req.run.token, message))
        except redis.RedisError as exc:
            # Admission retries Redis, and ends the rollout in error if it stays away.
            log.warning("rollout %s runs without a lease: %s", self.rollout, exc)
            return None
        if ticket.verdict == "live":
            log.info("rollout %s is running on %s: this copy is acknowledged", self.rollout,
                     ticket.detail)  # fmt: skip
            return self.end(Ended.REDELIVERED, detail=f"running on {ticket.detail}")
        if ticket.verdict == "settled":
            return self.end(Ended.REDELIVERED, detail="settled already")
        self.lease = ticket.lease
        return None

    async def settle(self, lease: Lease, outcome: RolloutOutcome) -> RolloutOutcome:
        """Settle the lease (now, gathered with the settlings of other rollouts that ended
        meanwhile, or as `settle_later` says), counting the rollout toward its generation's
        finish and publishing the finish if it was the last; an attempt that was taken over
        meanwhile ends `TAKEN_OVER`."""
        ctx, token = self.ctx, self.req.run.token
        leases, settles = ctx.leases, ctx.settles
        assert leases is not None and settles is not None
        later = self.delivery.settle_later
        settled = Settled(False)
        try:
            if later is not None:
                if await ctx.blocking(lambda: leases.current(lease, token)):
                    later(Settling(leases, lease, token))
                    return outcome
            else:
                count = self.delivery.finish is not None
                settled = await settles(SettleCall(lease, token, count))
        except redis.RedisError as exc:
            # Not counted: the lease expires and is taken over, and a new attempt counts it.
            leases.forget(lease)
            log.warning("rollout %s: its lease could not be settled: %s", self.rollout, exc)
            return outcome
        if not settled.counted:
            leases.forget(lease)
            if not lease.attempt:
                return self.end(Ended.REDELIVERED, detail="settled already")
            log.warning("rollout %s: this attempt was taken over; it ended %s and counts nothing",
                        self.rollout, outcome.ended.value)  # fmt: skip
            return self.end(
                Ended.TAKEN_OVER, detail=f"taken over; this attempt {outcome.ended.value}"
            )
        finish, publish = settled.finish, self.delivery.finish
        if finish is not None and publish is not None:
            log.info("rollout %s was the generation's last: publishing its finish", self.rollout)
            await ctx.blocking(lambda: publish(finish))
        return outcome

    def stamp_execution(self, records: list[dict[str, Any]]) -> None:
        """Stamp the records with this attempt's execution: its generation and lease's number."""
        attempt = self.lease.number if self.lease is not None else 0
        stamp_execution(records, self.req.run.generation, attempt)

    def staged(self, stage: Stage) -> None:
        if self.lease is not None and self.ctx.leases is not None:
            self.ctx.leases.stage(self.lease, stage)

    async def admitted(
        self, readmit: Ticket | None, waiting: Ticket | None = None
    ) -> RolloutOutcome | Ticket:
        """Admit the rollout, waiting on the loop (not on a thread) while the caps are full;
        `waiting`: the `wait` ticket of a try already made.

        A rollout that waits stands in its shard's and agent's line (`WaitingLines`): the first
        in it asks again after each pause, the next asks as soon as it leaves, and the rest ask
        only every `refresh_s` to stay listed as waiting."""
        ctx = self.ctx
        waits = AdmissionWaits(FIRST_WAIT_MAX_S)
        key = self.line
        async with ctx.lines.joined(key) as turn:
            while True:
                if waiting is not None:
                    if turn.done():  # first in line: a pause, cut short by a call's end
                        await self.until(ctx.lines.bell(key), waits.next_s())
                    else:
                        await self.until(turn, ctx.lines.refresh_s)
                got = await self.admit(readmit, waiting)
                if isinstance(got, RolloutOutcome) or got.verdict != "wait":
                    return got
                waiting = got

    async def until(self, event: asyncio.Future[None], seconds: float) -> None:
        """Until `event` is done or `seconds` went by (the context's sleep)."""
        if event.done():
            return
        slept = asyncio.ensure_future(self.ctx.sleep(seconds))
        try:
            await asyncio.wait((event, slept), return_when=asyncio.FIRST_COMPLETED)
        finally:
            slept.cancel()

    async def admit(
        self, readmit: Ticket | None, waiting: Ticket | None
    ) -> RolloutOutcome | Ticket:
        """Try to admit the rollout (again, after a rate-limit wait: no new start), in one round
        trip with the tries of the rollouts that ask meanwhile (`RolloutContext.admits`).

        The slot's ticket, the `wait` one while the caps are full, or the `worker_lost` one of a
        rollout past its attempt limit (its row lands: `lost`); or how the rollout ended: not
        admitted (`not_run`), or Redis away.
        """
        ctx = self.ctx
        seen = self.delivery.admission or self.req
        try:
            with tracing.step("rollouts.admission_wait") as traced:
                ticket = await ctx.admits(AdmitCall(seen, self.sid, readmit, waiting))
                traced.set("rollouts.readmit", readmit is not None)
                traced.set("rollouts.admission.verdict", ticket.verdict)
        except redis.RedisError as exc:
            log.error("rollout %s not started: Redis unavailable: %s", self.rollout, exc)
            return self.end(Ended.ERROR, detail=f"{type(exc).__name__}: {exc}")
        if ticket.verdict in ("wait", "worker_lost"):
            return ticket
        if ticket.verdict != "run":
            return await ctx.blocking(partial(self.not_run, ticket, seen))
        if readmit is None and self.req.feed is not None and ctx.feeds is not None:
            await ctx.blocking(self.note_version)
        self.staged("calling")
        if readmit is None and self.delivery.on_admitted is not None:
            await ctx.blocking(self.delivery.on_admitted)
        return ticket

    def note_version(self) -> None:
        """Note the feed's policy version as the rollout is admitted to call its agent (as this
        process read it at most half a second ago; read now with `stale_rollouts="rerun"`, whose
        rollouts are judged by it); blocking."""
        feed, feeds = self.req.feed, self.ctx.feeds
        if feed is None or feeds is None:
            return
        try:
            self.policy_version = feeds.current(feed) if feed.reruns else feeds.version(feed)
        except redis.RedisError as exc:  # the version read before it started stays
            log.warning("rollout %s: feed %s unreadable (%s)", self.rollout, feed.name, exc)

    async def rerun_stale(
        self, called: tuple[Ticket, CallOutcome, float]
    ) -> tuple[Ticket, CallOutcome, float] | RolloutOutcome:
        """With `stale_rollouts="rerun"`: call the agent again, with the same slot and under the
        feed's current version, while the call was cut for falling more than `max_policy_lag`
        behind it (`agent_call`) or ended with a result that far behind (that result is set
        aside: the shard's `_superseded` folder); each counted as a re-run, at most
        `max_stale_reruns`, then the result lands as it is (its group is handed out marked
        stale). A set-aside result whose re-runs end without one is counted dropped."""
        feed, feeds = self.req.feed, self.ctx.feeds
        if feed is None or feeds is None or not feed.reruns or not self.delivery.record:
            return called
        aside = False
        while True:
            slot, outcome, started = called
            version, cut, self.cut = self.policy_version, self.cut, None
            if cut is None and outcome.result is None:
                if aside:
                    await self.feed_count("dropped")
                return called
            if cut is not None:
                current: int | None = cut
                await self.feed_count("reruns")
            else:
                assert outcome.result is not None
                own = outcome.result.get(F.POLICY_VERSION)  # an agent's own version wins
                version = own if isinstance(own, int) else version
                try:
                    current = await self.ctx.blocking(lambda: feeds.current(feed))
                    if not feed.rerun(version, current, self.reruns):
                        return called
                    put = partial(self.set_aside, outcome.result, version, current, started)
                    await self.ctx.blocking(put)  # counted as a re-run there
                except Exception as exc:  # Redis, storage, the capture: it lands as it is
                    log.warning("rollout %s: its result lands as it is: %s", self.rollout, exc)
                    return called
                aside = True
            self.reruns += 1
            self.policy_version = current
            log.info("rollout %s: its call %s under policy %s, the feed's is %s: run again",
                     self.rollout, "cut" if cut is not None else "ended", version,
                     current)  # fmt: skip
            again = await self.call(slot)
            if isinstance(again, RolloutOutcome):
                if aside:
                    await self.feed_count("dropped")
                return again
            again[1].failures[:0] = outcome.failures  # its earlier attempts' rows still land
            again[1].requests_sent += outcome.requests_sent
            called = again

    async def feed_count(self, name: str) -> None:
        """Add one to the feed's count `name`; a Redis error only loses the count."""
        feed, feeds = self.req.feed, self.ctx.feeds
        assert feed is not None and feeds is not None
        try:
            await self.ctx.blocking(lambda: feeds.count(feed, name))
        except redis.RedisError as exc:
            log.warning("rollout %s: feed %s not counted (%s): %s", self.rollout, feed.name,
                        name, exc)  # fmt: skip

    def set_aside(
        self, result: dict[str, Any], version: int | None, current: int | None, started: float
    ) -> None:
        """Keep a stale result as evidence (`rerun_stale`), stamped as it would have landed, with
        its capture merged; the capture is cleared for the re-run."""
        feed, feeds = self.req.feed, self.ctx.feeds
        assert feed is not None and feeds is not None
        now = self.ctx.monotonic()
        row = merge_into(self.req, dict(result), (now - started) * 1000)
        stamp_timing([row], time.time() - (now - started), (now - started) * 1000)
        if version is not None:
            row.setdefault(F.POLICY_VERSION, version)
        self.stamp_execution([row])
        row[F.SET_ASIDE] = {"reason": "stale", "policy_version": current}
        clear_for(self.req)
        feeds.set_aside(feed, self.req.run, row, self.reruns + 1)

    async def attempt(self, ticket: Ticket) -> RolloutOutcome:
        """Call `/run` with the admitted slot, then sort and land the outcome."""
        ctx, token = self.ctx, self.req.run.token
        if ticket.verdict == "worker_lost":
            return await self.lost(ticket)
        called = await self.call(ticket)
        if not isinstance(called, RolloutOutcome):
            called = await self.rerun_stale(called)
        if isinstance(called, RolloutOutcome):
            return called
        slot, outcome, started = called
        ended_call = ctx.monotonic()
        duration_s: float | None = None
        let_go = False
        try:
            # The slot freed, the outcome sorted and its landing queued (encoded): here on the
            # loop when nothing of it waits (no capture to read), so a reply is encoded as soon
            # as it is parsed instead of waiting, parsed, for a step thread behind a wave of
            # others; else one hop off the loop.
            after = partial(self.after_call, slot, outcome, started, ended_call)
            if self.req.capture is None:
                result, failures, ended, queued = after()
            else:
                result, failures, ended, queued = await ctx.blocking(after)
            ctx.lines.ring(self.line)  # its slot is free: the first waiting for one asks now
            queued_ok = isinstance(queued, concurrent.futures.Future)
            if result is not None and queued_ok and not self.delivery.returns_record:
                # Encoded and queued (a retry queues the encoded records again): the parsed
                # result, often the largest thing a rollout holds, is not kept while it lands.
                outcome.result = result = None
                let_go = True
            if ended is Ended.LANDED and self.req.admission.dispatch_deadline is not None:
                duration_s = ended_call - started
            if self.delivery.record:
                ended = await self.land(result, failures, ended, queued)
        finally:
            ctx.gate.release(slot, token, duration_s=duration_s)  # queued: it never blocks
        kept = ended in RESULT_ENDS or ended in FAILURE_ENDS or ended is Ended.DUPLICATE
        record = None
        if not let_go:
            record = outcome.result if outcome.result is not None else failures[-1]
        if self.not_stored is not None:
            record = self.not_stored
        return self.end(
            ended,
            record=record if kept else None,
            detail=self.land_error,
            requests=outcome.requests_sent,
            run_ms=(ended_call - started) * 1000,
            after_ms=(ctx.monotonic() - ended_call) * 1000,
            health=self.verdict.as_json()
            if self.verdict is not None and ended is Ended.LANDED
            else None,
        )

    def after_call(
        self, ticket: Ticket, outcome: CallOutcome, started: float, ended_call: float
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]], Ended, Queued | None]:
        """The steps after `/run`: the slot freed (queued), the model calls merged (reading the
        capture: the one part that blocks), the outcome sorted into its records, stamped with
        its timing, and (a recorded delivery) encoded and their landing queued: the lander's
        future, or what queueing raised (`land_with_retry`)."""
        ctx = self.ctx
        # The slot covers the /run call: the next rollout may start while this one lands.
        ctx.gate.free_slot(ticket, self.req.run.token, ok=outcome.result is not None)
        if self.call_ended is not None:  # and so is this process's: a delivery taken ahead starts
            self.call_ended()
        if outcome.result is not None:  # the model-call capture, as NeMo Gym merges it
            outcome.result = merge_into(self.req, outcome.result, (ended_call - started) * 1000)
        result, failures, ended = sort_outcome(outcome)
        agent_row = failures[-1] if ended is Ended.AGENT_FAILURE else None
        if not self.delivery.record:
            # Returned as `/run` gave it: only the rows the collector built get the record.
            stamp_failure_records([f for f in failures if f is not agent_row], self.req.run.run_id)
            return result, failures, ended, None
        stamp_failure_records(failures, self.req.run.run_id, agent_row)
        at, ms = time.time() - (ctx.monotonic() - started), (ended_call - started) * 1000
        records = [*failures, *([] if result is None else [result])]
        stamp_timing(records, at, ms)
        if self.policy_version is not None:  # an agent that names its own version wins
            for record in records:
                record.setdefault(F.POLICY_VERSION, self.policy_version)
        if self.reruns and result is not None:
            result[F.STALE_RERUNS] = self.reruns
        self.stamp_execution(records)
        self.verdict = judge(self.req.health, result)
        queued: Queued
        try:
            queued = self.queue_landing(result, failures)
        except Exception as exc:  # raised where queueing it on its own would have
            queued = exc
        return result, failures, ended, queued

    async def call(self, first: Ticket) -> tuple[Ticket, CallOutcome, float] | RolloutOutcome:
        """Call `/run` with the admitted slot, waiting out 429/503s without it.

        Returns the slot's ticket, the call's outcome (its failures and requests over every
        admission) and when the first call started; or how the rollout ended before that.
        """
        req, ctx, token = self.req, self.ctx, self.req.run.token
        waits = RateLimitWaits(req.policy.rate_limit_budget_s)
        row = req.row
        earlier: list[dict[str, Any]] = []
        requests = 0
        started: float | None = None
        ticket = first
        while True:
            called = ctx.monotonic()
            started = called if started is None else started
            try:
                outcome, stop = await self.agent_call(row)
            except BaseException:
                ctx.gate.release(ticket, token)
                raise
            if outcome is None and self.cut is not None:  # stale: called again (`rerun_stale`)
                outcome = CallOutcome(requests_sent=1)
            elif outcome is None:
                ctx.gate.release(ticket, token, field=generation.CANCELLED)
                return self.end(Ended.CANCELLED, detail=stop)
            requests += outcome.requests_sent
            earlier += outcome.failures
            limited = outcome.rate_limited
            if limited is None:
                break
            wait_s = next_wait_s(req.policy, limited.retry_after_s, waits.count)
            call_s, status = ctx.monotonic() - called, limited.status
            if not waits.fits(wait_s):
                await ctx.blocking(partial(ctx.gate.back_off, ticket, status, None, call_s))
                outcome = CallOutcome(final_failure=budget_failure(waits, limited))
                break
            # The slot goes back for the wait: a rate-limited rollout holds no concurrency.
            await ctx.blocking(partial(ctx.gate.back_off, ticket, status, wait_s, call_s))
            ctx.lines.ring(self.line)
            waits.add(status, wait_s)
            with tracing.rate_limit_wait(status, wait_s):
                stop = await self.wait(wait_s)
            if stop is not None:
                ctx.gate.release(ticket, token, field=generation.CANCELLED)
                return self.end(Ended.CANCELLED, detail=stop)
            row = with_attempt(req.row, limited.attempt)
            # Admitted again without a new start.
            admitted = await self.admitted(ticket)
            if isinstance(admitted, RolloutOutcome):
                return admitted
            if admitted.verdict == "worker_lost":
                return await self.lost(admitted)
            ticket = admitted
        outcome.failures = earlier
        outcome.requests_sent = requests
        assert started is not None  # set by the first call
        return ticket, outcome, started

    async def agent_call(self, row: dict[str, Any]) -> tuple[CallOutcome | None, str | None]:
        """`/run`, cut (None, and `cut` set to the feed's version) when the rollout falls more
        than `max_policy_lag` behind its feed's version while it runs and it has re-runs left
        (`stale_rollouts="rerun"`): the agent sees the client go away."""
        ctx, req = self.ctx, self.req
        feed, feeds, version = req.feed, ctx.feeds, self.policy_version
        stale = None
        has_left = feed is not None and self.reruns < feed.reruns
        if has_left and feed is not None and feeds is not None and version is not None:
            stale = ctx.stale.wait(ctx.blocking, feeds, feed, version)
        outcome, stop = await ctx.agent.call(req.agent_url, row, req.policy, self.sid, stale)
        if stop == STALE and stale is not None:
            self.cut = stale.result()
        return outcome, stop

    async def wait(self, wait_s: float) -> str | None:
        """Sleep out a rate-limit wait; returns the stop reason if the run was failed or cancelled."""
        left = wait_s
        while left > 0:
            step = min(left, STOP_POLL_S)
            await self.ctx.sleep(step)
            left -= step
            reason = await self.ctx.blocking(lambda: self.ctx.gate.stop_reason(self.sid))
            if reason is not None and reason != "drain":
                return reason
        return None

    def not_run(self, ticket: Ticket, seen: CollectRequest) -> RolloutOutcome:
        """How a rollout that admission turned away ends."""
        verdict = ticket.verdict
        if verdict == "duplicate":
            return self.end(Ended.DUPLICATE)
        if verdict == "fenced":
            log.warning(
                "rollout %s not started: shard %s of %s was opened by another writer (%s) since "
                "this task's writer (%s)",
                self.rollout, self.req.run.shard, self.req.run.output_dir, ticket.detail,
                self.req.run.token,
            )  # fmt: skip
            return self.end(
                Ended.FENCED,
                detail=f"shard {self.req.run.shard} of {self.req.run.output_dir} was opened by "
                f"another writer",
            )
        if verdict in ("drained", "stopped"):
            budget_left = verdict == "drained" and float(ticket.detail) > 0
            margin = self.ctx.gate.margin_s(self.sid, seen) if budget_left else None
            row = drained_row(self.req.row, not_started_message(ticket, margin))
            return self.end(Ended(verdict), record=row, detail=ticket.detail)
        raise AssertionError(f"admission verdict {verdict!r} has no outcome")

    async def lost(self, ticket: Ticket) -> RolloutOutcome:
        """A rollout past its attempt limit: its `worker_lost` row lands."""
        lost = worker_lost_row(self.req, int(ticket.detail))
        stamp_failure_records([lost], self.req.run.run_id)
        ended = Ended.WORKER_LOST
        if self.delivery.record:
            self.stamp_execution([lost])
            ended = await self.land(None, [lost], ended)
        record = self.not_stored or lost
        return self.end(ended, record=record if ended in FAILURE_ENDS else None,
                        detail=self.land_error)  # fmt: skip

    async def land(
        self,
        result: dict[str, Any] | None,
        failures: list[dict[str, Any]],
        ended: Ended,
        queued: Queued | None = None,
    ) -> Ended:
        """Land the records (`queued`: already queued); returns how the rollout ended once they
        are (or could not be) down."""
        try:
            try:
                report = await self.land_with_retry(result, failures, queued)
            finally:
                # Landed or given up: the encoded lines (a result's is its whole reply) are not
                # kept while the rollout settles and waits for the tracer.
                self.encoded = None
        except ShardFencedError as exc:
            log.warning("%s", exc)
            self.land_error = str(exc)
            return Ended.FENCED
        except (StorageError, OSError, redis.RedisError, TransientError) as exc:
            log.error("rollout %s could not be landed: %s", self.rollout, exc)
            self.land_error = f"{type(exc).__name__}: {exc}"
            return Ended.ERROR
        final = failures[-1] if failures else None
        if report.not_stored is not None:
            # Its last record could not be encoded: the rollout failed, with the row stored instead.
            log.error("rollout %s: %s", self.rollout, report.not_stored[F.FAILURE_MESSAGE])
            self.not_stored = final = report.not_stored
            ended = Ended.FAILED
        routed = self.req.policy.route_failures_to_sidecar
        if ended in FAILURE_ENDS and self.delivery.fails_run and not routed and final is not None:
            message = run_failure_message(self.rollout, final)
            await self.ctx.blocking(lambda: self.ctx.gate.fail_run(self.sid, message))
        return Ended.DUPLICATE if report.duplicate else ended

    async def land_with_retry(
        self,
        result: dict[str, Any] | None,
        failures: list[dict[str, Any]],
        queued: Queued | None = None,
    ) -> LandReport:
        """Land the records, riding out a Redis restart or a busy lock for up to LAND_RETRY_S;
        `queued`: the first try, queued already (`after_call`).

        Each attempt waits at most `land_wait_s` for the lander: past it, `StorageError` (the
        records may land later; the rollout's outcome is an error, and a resume finds them).
        """
        ctx = self.ctx
        deadline = ctx.monotonic() + LAND_RETRY_S
        delay = 0.5
        while True:
            if queued is None:
                # Queued with the stage noted, off the loop (encoded there the first time; a retry
                # queues those records again).
                queued = await ctx.blocking(lambda: self.queue_landing(result, failures))
            elif isinstance(queued, Exception):
                raise queued
            try:
                # Shielded: a timeout must not cancel the lander's future (its thread settles
                # it later, and a cancelled one would refuse the report).
                waited = asyncio.shield(asyncio.wrap_future(queued))
                return await asyncio.wait_for(waited, ctx.land_wait_s)
            except TimeoutError:
                raise StorageError(
                    f"landing did not finish within {ctx.land_wait_s:g}s; "
                    "its records may land later"
                ) from None
            except (redis.ConnectionError, redis.TimeoutError, TransientError) as exc:
                if ctx.monotonic() + delay > deadline:
                    raise
                log.warning("landing %s: %s; retrying in %.1fs", self.rollout, exc, delay)
                await ctx.sleep(delay)
                delay = min(delay * 2, 5.0)
                queued = None

    def queue_landing(
        self, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> concurrent.futures.Future[LandReport]:
        """Queue the records for landing, encoded once: a retry queues the same encoded records
        again (`land_with_retry`), so the parsed records need not be kept for it."""
        self.staged("landing")
        lander = self.ctx.lander
        if self.encoded is None:
            self.encoded = lander.encode(result, failures)  # StorageError: nothing to land
            if self.encoded.result_key is not None:
                self.encoded.health = self.verdict
        return lander.enqueue(self.req.run, self.encoded, self.lease, self.req.feed)
