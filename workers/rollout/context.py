"""What the rollout engine works with: its collaborators, passed in as one per-process context.

The engine (`workers/rollout/engine.py`) reaches Redis, storage and the agent only through these:
an admission gate, a lander, an agent caller and the rollout leases. A worker process builds the real ones
once (`process_context`); unit tests build a context of in-memory fakes (`workers/rollout/fakes.py`)
and an agent caller whose client is an `httpx.AsyncClient` over `httpx.MockTransport`.

A rollout runs as a coroutine on the process's event loop: the `/run` call on it, the gate's and
the leases' Redis round trips and the lander's encoding on a few shared threads (`Blocking`), the
run's stop flags polled once per shard for all its rollouts (`StopWatch`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from infra import generation
from infra.http import EventLoopThread, PostClient
from schemas.feed import FeedMember, FeedState, is_stale
from schemas.messages import CallPolicy, CollectRequest, RunRef
from workers.rollout.admission import AdmitCall, Ticket
from workers.rollout.agent_call import CallOutcome, call_run
from workers.rollout.encoding import EncodedRecords
from workers.rollout.landing import LAND_WAIT_S, LandReport
from workers.rollout.leases import (
    Lease,
    LeaseTicket,
    ReplyPush,
    SettleCall,
    Settled,
    Stage,
    TakeCall,
)

STOP_POLL_S = 0.5
STALE = "stale"
"""Why `AgentCaller.call` cut a call whose rollout fell behind its feed's policy version."""

CALL_ENDED: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "rollouts_call_ended", default=None
)
"""Set by the rollout pool (`workers/pool.py`) in the task running a delivery: the engine calls it
(from any thread, once or more) when the rollout's `/run` call ended, so that a delivery taken
ahead starts while this one lands. Unset elsewhere (a thread pool, tests)."""

SLOT: contextvars.ContextVar[Callable[[], Awaitable[bool]] | None] = contextvars.ContextVar(
    "rollouts_slot", default=None
)
"""Set by the rollout pool in the task running a delivery taken ahead of its slots: the engine
awaits it once the delivery holds its rollout's lease, before admission, so that a delivery
waiting for a slot is leased like one waiting for admission (a worker that freezes, dies or is
cut off with it has it taken over within the lease TTL, whatever the broker). True: the slot is
the delivery's; False: the worker is stopping and the delivery must not start (it gives its lease
back, and the broker gives its message to another worker). Unset elsewhere: the slot, if any, was
taken before the delivery started."""

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741
GATHERED_MOST = 512
"""Calls one gathered step runs at most (`Gathered`)."""


class AdmissionGate(Protocol):
    """Whether a rollout may start, the slots it holds, and the run's stop flags (`workers/rollout/admission.py`)."""

    def try_admit_many(self, calls: list[AdmitCall]) -> list[Ticket | Exception]:
        """For each of `calls`, in one round trip: a slot's ticket, `wait` while the caps are
        full, or why the rollout must not start; a call that failed alone gets its error in its
        place."""
        ...

    def free_slot(self, ticket: Ticket, token: str, ok: bool = False) -> None: ...

    def back_off(
        self, ticket: Ticket, status: int, wait_s: float | None, call_s: float
    ) -> None: ...

    def release(
        self,
        ticket: Ticket,
        token: str,
        field: str = generation.DONE,
        duration_s: float | None = None,
    ) -> None:
        """Give the slot back and count the outcome; called on the event loop: never blocks."""
        ...

    def stop_reason(self, sid: str) -> str | None: ...

    def margin_s(self, sid: str, req: CollectRequest) -> float | None: ...

    def fail_run(self, sid: str, message: str) -> None: ...


class RecordLander(Protocol):
    """Lands a rollout's records in its shard exactly once (`workers/rollout/landing.py`)."""

    def encode(
        self, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> EncodedRecords:
        """The records as they land, each encoded on its own; `StorageError` if not even a
        record's identity can be encoded."""
        ...

    def enqueue(
        self,
        run: RunRef,
        records: EncodedRecords,
        lease: Lease | None = None,
        feed: FeedMember | None = None,
    ) -> concurrent.futures.Future[LandReport]:
        """Queue the encoded records (of the attempt holding `lease`), again for a retried
        landing; the future settles with the report, or the error that failed them
        (`ShardFencedError`: a newer writer or attempt). `feed`: the feed group the rollout
        enters as it lands."""
        ...


class FeedRoom(Protocol):
    """A feed's bound on unconsumed groups and its policy version
    (`workers/feed/backpressure.py`)."""

    def room(self, feed: FeedMember, sid: str) -> FeedState: ...

    def version(self, feed: FeedMember) -> int | None: ...

    def current(self, feed: FeedMember) -> int | None: ...

    def set_aside(self, feed: FeedMember, run: RunRef, row: dict[str, Any], rerun: int) -> str: ...

    def count(self, feed: FeedMember, name: str) -> None: ...


class LeaseKeeper(Protocol):
    """Rollout leases: who runs each rollout, and the takeover of silent ones (`workers/rollout/leases.py`)."""

    def take(self, sid: str, key: str, token: str, message: dict[str, Any]) -> LeaseTicket: ...

    def take_many(self, calls: list[TakeCall]) -> list[LeaseTicket | Exception]:
        """`take` for each of `calls` in one round trip; a call that failed alone gets its error
        in its place."""
        ...

    def stage(self, lease: Lease, stage: Stage) -> None: ...

    def current(self, lease: Lease, token: str) -> bool: ...

    def fresh(self, lease: Lease) -> bool:
        """Known current without a round trip: taken or renewed recently by this process."""
        ...

    def settle(
        self, lease: Lease, token: str, reply: ReplyPush | None = None, count: bool = False
    ) -> Settled: ...

    def settle_many(self, calls: list[SettleCall]) -> list[Settled | Exception]:
        """`settle` for each of `calls` in one round trip; a call that failed alone gets its
        error in its place."""
        ...

    def forget(self, lease: Lease) -> None: ...

    def give_back(self, lease: Lease) -> None:
        """Drop the lease of an attempt that never started, settling nothing."""
        ...


class RunCheck(Protocol):
    """Why a task's run fields must not be trusted, or None (`ManifestCheck`)."""

    def refusal(self, run: RunRef, agent_url: str) -> str | None: ...

    def vouched(self, run: RunRef, agent_url: str) -> bool:
        """Whether `refusal` said None already (it would answer without a read)."""
        ...


class StepThreads:
    """A few threads that run blocking steps for coroutines, lighter than `run_in_executor`.

    A step is queued with the event loop's own future; the thread that ran it hands the value
    back with one `call_soon_threadsafe` for all the values that finished while the loop had not
    taken the last ones yet. `run_in_executor` spends, per step, a `concurrent.futures.Future`
    (a `Condition`, hence a lock), the chaining of two futures and a wake-up of the loop; py-spy
    put a fifth of a worker's samples there while 4,096 rollouts started. A step whose awaiting
    coroutine was cancelled before it started is not run.
    """

    def __init__(self, count: int, name: str) -> None:
        self._steps: collections.deque[_Step] = collections.deque()
        self._first: collections.deque[_Step] = collections.deque()
        """Steps taken before any in `_steps` (`submit(first=True)`)."""
        self._ready: queue.SimpleQueue[None] = queue.SimpleQueue()
        """One token per step queued, in either deque, put after the step: a thread that took a
        token finds a step. (A `threading.Semaphore` here, a Python-level `Condition`, was 2%
        of a worker's samples in its `release`; this queue's put and get are C.)"""
        self._lock = threading.Lock()
        self._done: dict[asyncio.AbstractEventLoop, list[_Settled]] = {}
        for i in range(count):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(
        self, loop: asyncio.AbstractEventLoop, step: Callable[[], T], first: bool = False
    ) -> asyncio.Future[T]:
        """Queue `step` (run in the caller's context); its value or exception comes on `loop`.
        A step queued `first` runs before every step queued without (a rollout's start, ahead
        of the landings and settlings of those that ended)."""
        future: asyncio.Future[T] = loop.create_future()
        (self._first if first else self._steps).append(
            (loop, future, contextvars.copy_context(), step)
        )
        self._ready.put(None)
        return future

    def _work(self) -> None:
        while True:
            self._ready.get()
            try:
                loop, future, context, step = self._first.popleft()
            except IndexError:
                loop, future, context, step = self._steps.popleft()
            if future.cancelled():  # read off the loop: at worst a cancelled step runs anyway
                continue
            value: Any = None
            error: BaseException | None = None
            try:
                value = context.run(step)
            except StopIteration as exc:  # a future cannot hold one
                error = RuntimeError(f"a step raised StopIteration: {exc!r}")
            except BaseException as exc:  # handed to the awaiting coroutine, as an executor does
                error = exc
            self._hand_back(loop, future, value, error)

    def _hand_back(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        value: Any,
        error: BaseException | None,
    ) -> None:
        with self._lock:
            waiting = self._done.get(loop)
            if waiting is not None:  # the loop has a call to take them coming already
                waiting.append((future, value, error))
                return
            self._done[loop] = [(future, value, error)]
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits them any more
            loop.call_soon_threadsafe(self._settle, loop)

    def _settle(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            done = self._done.pop(loop, [])
        for future, value, error in done:
            if future.cancelled():
                continue
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)


_Step = tuple[
    asyncio.AbstractEventLoop, "asyncio.Future[Any]", contextvars.Context, Callable[[], Any]
]
_Settled = tuple["asyncio.Future[Any]", Any, BaseException | None]
"""A step's future, its value and its error (None: it returned the value)."""


class Blocking:
    """Runs the engine's blocking steps (Redis round trips, storage, encoding) off the event loop.

    A rollout is a coroutine on its process's event loop; what it does that blocks goes to a
    few threads shared by every rollout of the process (`StepThreads`), so thousands in flight
    cost coroutines, not threads. Without threads (unit tests over in-memory fakes) a step runs
    inline.
    """

    def __init__(self, threads: StepThreads | None = None) -> None:
        self._threads = threads

    async def __call__(self, step: Callable[[], T], first: bool = False) -> T:
        if self._threads is None:
            return step()
        # The step sees the rollout's context (its trace, `workers/tracing.py`) on the thread.
        return await self._threads.submit(asyncio.get_running_loop(), step, first)


class Gathered(Generic[I, T]):
    """Calls of one blocking function gathered on the event loop and run many at a time, in one
    step (a group commit): `run_many(items)` gives each item's value or exception in its place.

    The first call starts a step at once; the calls made while it runs wait for it and go
    together in the next (at most `most`). So a burst of rollouts ending together settles in a
    few round trips instead of one each, which the step threads (a start goes first) would only
    reach behind the starts of the next wave, each rollout holding its delivery meanwhile. A
    call whose awaiting coroutine was cancelled before its step took it is not run, as a step.
    """

    def __init__(
        self,
        run_many: Callable[[list[I]], list[T | Exception]],
        blocking: Blocking,
        most: int = GATHERED_MOST,
        first: bool = False,
    ) -> None:
        self._run_many = run_many
        self._blocking = blocking
        self._most = most
        self._first = first
        """Its steps go ahead of the others in the step threads' queue (`StepThreads.submit`)."""
        self._waiting: list[tuple[I, asyncio.Future[T]]] = []
        self._step: asyncio.Task[None] | None = None

    async def __call__(self, item: I) -> T:
        loop = asyncio.get_running_loop()
        if self._step is not None and self._step.get_loop() is not loop:
            self._waiting, self._step = [], None  # another loop's (a test's, a forked parent's)
        future: asyncio.Future[T] = loop.create_future()
        self._waiting.append((item, future))
        if self._step is None:  # in a context of its own: it serves every caller's rollout
            self._step = loop.create_task(self._steps(), context=contextvars.Context())
        return await future

    async def _steps(self) -> None:
        taken: list[tuple[I, asyncio.Future[T]]] = []
        try:
            while self._waiting:
                taken = [(i, f) for i, f in self._waiting[: self._most] if not f.cancelled()]
                del self._waiting[: self._most]
                if not taken:
                    continue
                items = [item for item, _ in taken]
                try:
                    values = await self._blocking(partial(self._run_many, items), self._first)
                except Exception as exc:  # each caller sees it, as it would its own step's
                    values = [exc] * len(taken)
                for (_, future), value in zip(taken, values, strict=True):
                    if future.done():
                        continue
                    if isinstance(value, Exception):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
        except asyncio.CancelledError:  # the loop is closing: nobody waits in vain
            for _, future in [*taken, *self._waiting]:
                future.cancel()
            self._waiting = []
            raise
        finally:
            self._step = None


class StopWatch:
    """The run's stop flags for every rollout of a process that waits on `/run`: one poll per
    shard every `poll_s`, however many of its rollouts are in flight.

    `wait(sid)` is a future that resolves with the reason when the run is failed or cancelled
    (a drain lets calls finish); a poller runs for a shard while anyone waits on it.
    """

    def __init__(
        self,
        reason: Callable[[str], str | None],
        blocking: Blocking,
        poll_s: float = STOP_POLL_S,
    ) -> None:
        self._reason = reason
        self._blocking = blocking
        self._poll_s = poll_s
        self._waiters: dict[str, set[asyncio.Future[str]]] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}

    def wait(self, sid: str) -> asyncio.Future[str]:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str] = loop.create_future()
        self._waiters.setdefault(sid, set()).add(waiter)
        waiter.add_done_callback(lambda done: self._left(sid, done))
        if sid not in self._pollers:
            self._pollers[sid] = loop.create_task(self._poll(sid))
        return waiter

    def _left(self, sid: str, waiter: asyncio.Future[str]) -> None:
        """A waiter is done; the shard's poller stops with its last one."""
        waiters = self._waiters.get(sid)
        if waiters is None:
            return
        waiters.discard(waiter)
        if not waiters:
            del self._waiters[sid]
            poller = self._pollers.pop(sid, None)
            if poller is not None:
                poller.cancel()

    async def _poll(self, sid: str) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            reason = await self._blocking(lambda: self._reason(sid))
            if reason is not None and reason != "drain":
                for waiter in list(self._waiters.get(sid, ())):
                    if not waiter.done():
                        waiter.set_result(reason)


class StaleWatch:
    """The feed's policy version for every rollout of a process whose call may be cut when it
    falls behind (`stale_rollouts="rerun"`): one read per feed every `poll_s`, however many of
    its rollouts are in flight.

    `wait(...)` is a future that resolves with the feed's version once a rollout of `version`
    is stale against it (`schemas.feed.is_stale`); a poller runs for a feed while anyone waits.
    """

    def __init__(self, poll_s: float = STOP_POLL_S) -> None:
        self.poll_s = poll_s
        self._waiters: dict[str, dict[asyncio.Future[int], int]] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}

    def wait(
        self, blocking: Blocking, feeds: FeedRoom, feed: FeedMember, version: int
    ) -> asyncio.Future[int]:
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(feed.name, {})[waiter] = version
        waiter.add_done_callback(lambda done: self._left(feed.name, done))
        if feed.name not in self._pollers:
            poll = self._poll(blocking, feeds, feed)
            self._pollers[feed.name] = asyncio.get_running_loop().create_task(poll)
        return waiter

    def _left(self, name: str, waiter: asyncio.Future[int]) -> None:
        waiters = self._waiters.get(name)
        if waiters is None:
            return
        waiters.pop(waiter, None)
        if not waiters:
            del self._waiters[name]
            poller = self._pollers.pop(name, None)
            if poller is not None:
                poller.cancel()

    async def _poll(self, blocking: Blocking, feeds: FeedRoom, feed: FeedMember) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                current = await blocking(lambda: feeds.current(feed))
            except Exception:  # Redis away: the call ends as it would, and is judged then
                continue
            for waiter, version in list(self._waiters.get(feed.name, {}).items()):
                if not waiter.done() and is_stale(version, current, feed.max_lag):
                    assert current is not None  # stale against a version
                    waiter.set_result(current)


WAIT_REFRESH_S = 10.0
"""How often a rollout waiting behind others in its line asks for a slot anyway: its entry in the
waiting lists (`rollouts status`, stall detection) expires a lease TTL (30 s by default) after
its last try (a worker asks every third of a shorter TTL)."""
FIRST_WAIT_MAX_S = 0.05
"""The longest pause of the first in a line between its tries (10-50 ms, jittered): one poller
per line and process, so a slot freed elsewhere in the cluster is taken within 50 ms."""


class WaitingLines:
    """The rollouts of a process that wait for a slot take turns asking for one.

    A rollout that admission told to wait joins the line of its shard and agent (their caps are
    the same for all of it); only the first in line asks again, after pauses of 10-50 ms or as
    soon as a call of this process to that agent ended (`ring`), and the next one asks as soon
    as it leaves (admitted, or ended), since a slot that came back may be followed by more.
    Before this, each waiting rollout asked on its own every 20-250 ms: 1,000 rollouts waiting
    out an agent window's slow start made ~9,300 begin calls (a step thread's hop and a Redis
    script each) in an `inflight-1k` run of 4,000 rollouts. The others ask only every
    `refresh_s`, to stay listed as waiting.
    """

    def __init__(self, refresh_s: float = WAIT_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._lines: dict[tuple[str, str], collections.deque[asyncio.Future[None]]] = {}
        self._bells: dict[tuple[str, str], asyncio.Future[None]] = {}

    @contextlib.asynccontextmanager
    async def joined(self, key: tuple[str, str]) -> AsyncIterator[asyncio.Future[None]]:
        """Stand in `key`'s line; the future is done once this rollout is first in it."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._lines.setdefault(key, collections.deque())
        line.append(turn)
        if line[0] is turn:
            turn.set_result(None)
        try:
            yield turn
        finally:
            if line[0] is turn:
                line.popleft()
                if line:
                    line[0].set_result(None)
            else:
                line.remove(turn)
            if not line:
                del self._lines[key]
                self._bells.pop(key, None)  # nobody waits on it: a shard long done keeps none

    def bell(self, key: tuple[str, str]) -> asyncio.Future[None]:
        """Done at the next `ring` of `key` (the first in its line waits on it between tries)."""
        bell = self._bells.get(key)
        if bell is None or bell.done():
            bell = self._bells[key] = asyncio.get_running_loop().create_future()
        return bell

    def ring(self, key: tuple[str, str]) -> None:
        """A call of this process to `key`'s agent ended (its slot is free): the first in the
        line asks now. On the loop."""
        bell = self._bells.pop(key, None)
        if bell is not None and not bell.done():
            bell.set_result(None)

    def waiting(self, key: tuple[str, str]) -> int:
        """How many of this process's rollouts stand in `key`'s line."""
        line = self._lines.get(key)
        return 0 if line is None else len(line)

    @property
    def empty(self) -> bool:
        """No line and no bell left (every line's last rollout left)."""
        return not self._lines and not self._bells


class AgentCaller:
    """`call_run` on the event loop, cut when the run is failed or cancelled meanwhile.

    The cut cancels the rollout's own task while it waits in the call (no task of the call's
    own: a reply is then parsed, sorted and encoded in one step, and its parsed form never waits
    in the loop's queue behind other replies); the cancel closes the call's connection, and
    the agent sees the client go away.
    """

    def __init__(self, client: Callable[[], PostClient], stops: StopWatch) -> None:
        self._client = client
        self._stops = stops

    async def call(
        self, agent_url: str, row: dict[str, Any], policy: CallPolicy, sid: str,
        stale: asyncio.Future[int] | None = None,
    ) -> tuple[CallOutcome | None, str | None]:  # fmt: skip
        """The call's outcome; or None and why it was cut: the run's stop reason, or `stale`
        when `stale` (`StaleWatch.wait`) resolved first."""
        task = asyncio.current_task()
        assert task is not None
        stopped = self._stops.wait(sid)
        waits: tuple[asyncio.Future[Any], ...] = (stopped,) if stale is None else (stopped, stale)
        cut = False
        calling = True

        def cut_call(waiter: asyncio.Future[Any]) -> None:
            # Run by the loop between the task's steps: while it still waits in the call.
            nonlocal cut
            if calling and not cut and not waiter.cancelled():
                cut = True
                task.cancel()

        for waiter in waits:
            waiter.add_done_callback(cut_call)
        try:
            outcome = await call_run(self._client(), agent_url, row, policy)
        except asyncio.CancelledError:
            # Cancelled by the cut alone: swallowed (a cancel from outside besides it stays).
            if not cut or task.uncancel() > 0:
                raise
            outcome = None
        finally:
            calling = False
            for waiter in waits:
                waiter.remove_done_callback(cut_call)
                if not waiter.done():
                    waiter.cancel()
        if outcome is not None:
            if cut:  # the call ended with its reply though cancelled: the cancel is spent
                task.uncancel()
            return outcome, None
        # The run's stop wins over falling behind: a stopped run calls nothing again.
        if stopped.done() and not stopped.cancelled():
            return None, stopped.result()
        return None, STALE


@dataclass(frozen=True)
class RolloutContext:
    """A worker process's collaborators of the rollout engine."""

    gate: AdmissionGate
    """Admission, slots, stop flags."""
    lander: RecordLander
    """The group-commit writer of the shards."""
    agent: AgentCaller
    """The `/run` caller (unit tests give it an `httpx.AsyncClient` over `httpx.MockTransport`)."""
    loop: EventLoopThread
    """The event loop the rollouts of a pool thread run on (`run_rollout`)."""
    blocking: Blocking = field(default_factory=Blocking)
    """Where the engine's blocking steps run."""
    monotonic: Callable[[], float] = field(default=time.monotonic)
    """The clock durations are measured with."""
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep)
    """How the engine waits between landing retries and out rate limits."""
    land_wait_s: float = LAND_WAIT_S
    """How long one landing attempt may take before the rollout ends in error."""
    leases: LeaseKeeper | None = None
    """The rollout leases; None: deliveries take none."""
    runs: RunCheck | None = None
    """Vouches for a recorded task's run fields before anyone is called (the shard's manifest,
    `workers/shard/trust.py`); None trusts every task (unit tests of the other steps)."""
    lines: WaitingLines = field(default_factory=WaitingLines)
    """Where the rollouts told to wait for a slot take turns asking again."""
    feeds: FeedRoom | None = None
    """Whether a rollout's feed is full (`workers/feed/backpressure.py`); None: never."""
    stale: StaleWatch = field(default_factory=StaleWatch)
    """Cuts a call whose rollout fell behind its feed's policy version (`stale_rollouts`)."""
    takes: Gathered[TakeCall, LeaseTicket] | None = field(default=None, init=False)
    """The leases taken by deliveries that start together, gathered (`LeaseKeeper.take_many`),
    ahead of other steps as any start; None without leases."""
    settles: Gathered[SettleCall, Settled] | None = field(default=None, init=False)
    """The leases' settlings, gathered (`LeaseKeeper.settle_many`); None without leases."""
    admits: Gathered[AdmitCall, Ticket] = field(init=False)
    """The admissions of deliveries that start together, gathered (`AdmissionGate.try_admit_many`),
    ahead of other steps as any start."""

    def __post_init__(self) -> None:
        admits = Gathered(self.gate.try_admit_many, self.blocking, first=True)
        object.__setattr__(self, "admits", admits)
        if self.leases is not None:
            takes = Gathered(self.leases.take_many, self.blocking, first=True)
            object.__setattr__(self, "takes", takes)
            object.__setattr__(self, "settles", Gathered(self.leases.settle_many, self.blocking))
