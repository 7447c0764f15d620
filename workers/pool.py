"""The rollout pool: a Celery execution pool in which an in-flight rollout is a coroutine.

`celery -A workers.app worker` uses it (`celeryconfig.worker_pool`); `-c` is the number of
rollouts in flight in the process. A delivered message of a task registered with `on_loop` (the
two rollout tasks) runs in two parts:

1. on the process's event loop (`infra/http.py`, where `/run` is called): the task's coroutine
   runs the rollout to its outcome: admission, `/run`, landing, each blocking step on the rollout
   engine's few shared threads (`workers/rollout/context.py`);
2. on one of a few *finishing* threads: Celery's own tracer runs the task with that outcome (its
   body takes it from `take_ran` instead of running the rollout again): the result stored if
   any, and the request's callback acknowledges the message (late ack) and sends Flower its
   events.

So a rollout keeps everything the threads pool gives it (one Celery task per rollout, late
acknowledgement after landing, redelivery of what a dead worker held, Flower's view, task
events, `Ignore`) without a thread of its own. Any other task (the finish step, health jobs)
runs on a thread, as in the threads pool.

Why not an existing pool: Celery's own pools spend a thread (threads), a process (prefork) or a
monkey-patched greenlet (gevent, eventlet: our `/run` client is asyncio) per task;
celery-aio-pool is AGPL-licensed, celery-pool-asyncio unmaintained since 2021 and patches
Celery's internals. This pool uses only `BasePool`'s documented hooks and Celery's tracer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import redis
from celery import bootsteps
from celery.app.task import Context
from celery.concurrency.base import BasePool, apply_target
from kombu.serialization import loads as loads_message
from kombu.serialization import prepare_accept_content

from infra import keys
from infra.environment import from_env, redis_url
from infra.http import process_io
from infra.redis_client import client
from workers.gc_tuning import gc_state
from workers.malloc_tuning import malloc_state
from workers.rollout.context import CALL_ENDED, SLOT, StepThreads

log = logging.getLogger(__name__)

Runner = Callable[..., Awaitable[Any]]
"""A task's coroutine: called with the task's request (a `RequestView`) and its arguments; what
it returns is what the task body takes with `take_ran`."""

FINISHING_THREADS = 2
"""Threads per process running Celery's tracer for a rollout that has its outcome: an
acknowledgement and events, under a millisecond each (few: see BLOCKING_THREADS)."""

LEND_FRACTION = 4
"""A worker lends its consumer at most one message of prefetch per this many slots
(`RolloutPool.lend_cap`)."""

_runners: dict[str, Runner] = {}


R = TypeVar("R", bound=Runner)


OWN_SLOT = "rollouts_own_slot"
"""Set on a coroutine registered with `on_loop(own_slot=True)`."""


def on_loop(name: str, own_slot: bool = False) -> Callable[[R], R]:
    """Register `name`'s coroutine: the rollout pool runs a delivery of the task with it first.
    `own_slot`: a delivery taken ahead of the slots starts at once, and its coroutine awaits its
    slot (`SLOT`) itself; else the pool waits for the slot before starting it."""

    def register(runner: R) -> R:
        if own_slot:
            setattr(runner, OWN_SLOT, True)
        _runners[name] = runner
        return runner

    return register


class RequestView:
    """A delivery's request as its task's coroutine reads it: the attributes of Celery's
    `Context` (its defaults where the delivery has none), read in place from the chord the body
    embeds and the request dict Celery keeps for the delivery until its acknowledgement.

    Celery's tracer builds a `Context` from a merged copy of the two, and a second copy for its
    custom `headers`: about 2.2 KB more per rollout held, by tracemalloc. This view has no
    `headers` of its own: a header is an attribute, as in `Context`.
    """

    __slots__ = ("_embed", "_request")

    def __init__(self, request: dict[str, Any], embed: dict[str, Any] | None) -> None:
        self._request = request
        self._embed = embed

    def __getattr__(self, name: str) -> Any:
        embed = self._embed
        if embed is not None and name in embed:
            return embed[name]
        try:
            return self._request[name]
        except KeyError:
            pass
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(Context, name)  # Context's default, or AttributeError as Context raises


class _Raised:
    """What a task's coroutine raised, for its body to raise in Celery's tracer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


DELIVERY = "rollouts_delivery"
"""The request field (`self.request.rollouts_delivery`) naming one delivery in this process: two
copies of one message (a redelivery while the first runs) share their task id."""

_deliveries = itertools.count(1)
_ran: dict[int, Any] = {}
"""Each delivery's coroutine's value, by delivery, until its body takes it."""
_NOTHING = object()


def delivery_key(request: Any) -> tuple[str, int]:
    """One delivery of a task in this process: its task id and the pool's number for it, or the
    thread running it (another pool: the body runs in one thread from start to end)."""
    number = getattr(request, DELIVERY, None)
    return request.id, number if number is not None else -threading.get_ident()


def take_ran(request: Any) -> Any:
    """What the coroutine of the delivery `request` (a task's `self.request`) returned (raising
    what it raised), or None when it did not run on the loop (another pool: the body does the
    work itself)."""
    number = getattr(request, DELIVERY, None)
    found = _ran.pop(number, _NOTHING) if number is not None else _NOTHING
    if found is _NOTHING:
        return None
    if isinstance(found, _Raised):
        raise found.exc
    return found


class RolloutPool(BasePool):  # type: ignore[misc]  # celery's BasePool is untyped
    """Rollouts as coroutines on the process's event loop; other tasks on threads."""

    body_can_be_buffer = True
    signal_safe = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ahead = from_env().prefetch_ahead or 0
        """Deliveries held beyond the `limit` slots while all are busy (`ROLLOUTS_PREFETCH_AHEAD`,
        none by default); a slot given back while its rollout lands is refilled by a lent
        message instead (`lend`, `PrefetchAhead`)."""
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.limit, thread_name_prefix="rollouts-task"
        )
        self._finishing = StepThreads(FINISHING_THREADS, "rollouts-finish")
        self._lock = threading.Lock()
        self._pending: list[Coroutine[Any, Any, None]] = []
        """Deliveries handed over and not started on the loop yet (under `_lock`)."""
        self._waking = False
        """A call to start the pending deliveries is queued on the loop (under `_lock`)."""
        self._live = 0
        """Deliveries handed over and not ended (under `_lock`): what a warm shutdown waits for."""
        self._idle = threading.Condition(self._lock)
        self._stopping = False
        """A warm stop began: a delivery that has no slot yet does not start (`_run`)."""
        self._waiting: dict[int, str] = {}
        """The broker's delivery tags of the deliveries waiting for a slot, by delivery (loop
        only): kept marked as held (`_keep_held`)."""
        self._keeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        """The deliveries' tasks on the loop (touched on the loop only)."""
        self._slots: asyncio.Semaphore | None = None
        self.consumer: Any = None
        """Celery's consumer of this worker (set by `PrefetchAhead`): its prefetch is lent a
        message while a rollout that gave its slot back lands (`_Slot.give_back`)."""
        self.lend_cap = max(1, self.limit // LEND_FRACTION)
        """At most this many messages lent at once: while landing stalls (a store outage), a
        worker holds at most `limit + ahead + lend_cap` messages, not one more per freed slot."""
        self.lent = 0
        """Messages lent and not paid back yet (touched on the loop only)."""

    @property
    def num_processes(self) -> int:
        """What Celery sizes the prefetch by (`PrefetchAhead`, and after a reconnection): the
        slots and the deliveries taken ahead of them."""
        return int(self.limit) + self.ahead

    def on_start(self) -> None:
        self._loop = process_io().loop
        # Only a Redis broker is swept for unstarted messages (`_keep_held`); another redelivers
        # by itself.
        self._swept_broker = redis_url(self.app.conf.broker_url)
        self._accept = prepare_accept_content(self.app.conf.accept_content)  # type: ignore[no-untyped-call]

    def on_stop(self) -> None:
        """Warm shutdown: the rollouts in flight finish (and are acknowledged) first; one taken
        ahead that has no slot yet is not started and not acknowledged (the broker restores it
        when the worker's channel closes, else the unacked sweep does: another worker runs it)."""
        with self._idle:
            self._stopping = True
            while self._live:
                self._idle.wait()
        self._threads.shutdown(cancel_futures=True)

    def on_terminate(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def on_apply(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **_: Any,
    ) -> concurrent.futures.Future[Any] | None:
        """A task on a thread (its future), or a rollout handed to the loop (None: Celery keeps
        the value only to terminate the job, which a coroutine does not support)."""
        args = tuple(args or ())
        runner = _runners.get(args[0]) if args else None
        if runner is None:
            return self._threads.submit(
                apply_target, target, args, kwargs, callback, accept_callback
            )
        delivery = self._run(runner, target, args, kwargs or {}, callback, accept_callback)
        with self._lock:
            self._pending.append(delivery)
            self._live += 1
            wake, self._waking = not self._waking, True
        if wake:  # one wake-up of the loop for a claim's batch of deliveries
            self._loop.loop.call_soon_threadsafe(self._start_pending)
        return None

    def _start_pending(self) -> None:
        """On the loop: a task for each delivery handed over since the last call."""
        with self._lock:
            pending, self._pending, self._waking = self._pending, [], False
        for delivery in pending:
            task = self._loop.loop.create_task(delivery)
            self._tasks.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        with self._idle:
            self._live -= 1
            if not self._live:
                self._idle.notify_all()
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout pool: a delivery failed outside its task", exc_info=task.exception())

    async def _run(
        self,
        runner: Runner,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        callback: Callable[..., Any] | None,
        accept_callback: Callable[..., Any] | None,
    ) -> None:
        """Run the task's coroutine, then Celery's tracer with its value on a finishing thread.

        A delivery waits for one of the `limit` slots before its coroutine starts, unless its
        task's coroutine takes the slot itself (`on_loop(own_slot=True)`, the rollout tasks):
        then a delivery taken ahead starts at once and awaits `SLOT` after its first step (its
        rollout's lease), so that it waits for its slot leased."""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        number = next(_deliveries)
        # Celery's request dict of this delivery (its `Request` keeps it for this delivery
        # alone), marked in place: a copy was a kilobyte more per rollout held.
        request: dict[str, Any] = args[2]
        request[DELIVERY] = number
        body, content_type, content_encoding = args[3:6]
        slot = _Slot(self, loop, self._slots, number, request, accept_callback)
        own = getattr(runner, OWN_SLOT, False) and self._slots.locked()
        if not own and not await slot.take():
            return  # taken ahead and still waiting when the warm stop began
        ended = CALL_ENDED.set(slot.give_back)
        waits = SLOT.set(slot.take if own else None)
        try:
            try:
                decoded = _decoded_body(accept_callback, body, content_type)
                if decoded is None:
                    decoded = loads_message(  # type: ignore[no-untyped-call]
                        body, content_type, content_encoding, accept=self._accept
                    )
                task_args, task_kwargs, embed = decoded
                # The tracer takes the decoded body as it is (no content type: nothing to decode).
                args = (*args[:3], decoded, None, None, *args[6:])
                # The task's request as Celery's tracer builds it: the headers, and the chord the
                # body embeds (protocol 2), read in place.
                view = RequestView(request, embed)
                _ran[number] = await runner(view, *task_args, **task_kwargs)
            except Exception as exc:
                _ran[number] = _Raised(exc)
        finally:
            SLOT.reset(waits)
            CALL_ENDED.reset(ended)
            slot.release()
        if slot.refused:  # not started: left unacknowledged for another worker
            _ran.pop(number, None)
            return
        # The lent message is paid back before the acknowledgement, not after: the consumer
        # must not see the acknowledged message's room and the lent one at once, and claim a
        # message that then waits behind busy slots.
        self.repay(slot.lent)
        await slot.accept()  # a delivery that ended before it needed a slot (a copy)
        # The tracer's own steps (result, after_return, acknowledgement, events).
        try:
            await self._finishing.submit(
                loop, lambda: apply_target(target, args, kwargs, callback, None)
            )
        finally:
            _ran.pop(number, None)

    def lend(self) -> Any:
        """Raise the consumer's prefetch by one (Celery applies it on its next loop turn): a
        rollout gave its slot back and keeps its message until it landed (`repay`). The QoS
        lent to, or None (no consumer, or `lend_cap` messages lent already)."""
        qos = getattr(self.consumer, "qos", None)
        if qos is None or self.lent >= self.lend_cap:
            return None
        qos.increment_eventually()
        self.lent += 1
        return qos

    def repay(self, qos: Any) -> None:
        """Once the rollout landed, before its message is acknowledged: lower the prefetch
        again, unless the consumer has a new QoS since (a reconnection sizes it afresh)."""
        if qos is None:
            return
        self.lent -= 1
        current: Any = getattr(self.consumer, "qos", None)
        if current is qos:
            current.decrement_eventually()

    async def _keep_held(self) -> None:
        """While deliveries wait for a slot, mark them held every third of the lease TTL.

        A delivery waiting for a slot has taken no lease yet, and `UnackedSweep`
        (`workers/redispatch.py`) publishes again any message unacknowledged for longer than the
        lease TTL whose rollout holds no lease: a frozen worker's. Its time in the broker's
        unacknowledged index is moved to now instead (kombu's visibility timeout reads the same
        time), so only a worker that stopped renewing loses its waiting deliveries.
        """
        loop = asyncio.get_running_loop()
        every = from_env().lease_ttl_s / 3
        while self._waiting:
            await asyncio.sleep(every)
            tags = list(self._waiting.values())
            if tags:
                await self._finishing.submit(loop, partial(self._mark_held, tags))

    def _mark_held(self, tags: list[str]) -> None:
        assert self._swept_broker is not None  # no tag is kept otherwise
        try:
            client(self._swept_broker).zadd(
                keys.KOMBU_UNACKED_INDEX, dict.fromkeys(tags, time.time()), xx=True
            )
        except redis.RedisError as exc:
            log.warning("could not mark %d waiting deliveries as held: %s", len(tags), exc)

    def _get_info(self) -> dict[str, Any]:
        info: dict[str, Any] = super()._get_info()
        with self._lock:
            held = self._live
        info.update(
            {
                "max-concurrency": self.limit,
                "prefetch-ahead": self.ahead,
                "prefetch-lent": self.lent,
                # in their `/run` call (at most max-concurrency), landing, or taken ahead
                "deliveries": held,
                "gc": gc_state(),
                "malloc": malloc_state(),
            }
        )
        return info


def _delivery_tag(request: dict[str, Any]) -> str | None:
    """The broker's tag of a delivery (kombu's virtual transports put it in the properties)."""
    tag = (request.get("properties") or {}).get("delivery_tag")
    return tag if isinstance(tag, str) else None


def _decoded_body(
    accept_callback: Callable[..., Any] | None, body: Any, content_type: str | None
) -> Any:
    """The message body as Celery's consumer decoded it already, or None.

    Celery's strategy reads every message's `payload` (kombu decodes the body once and keeps
    it) to tell the protocol, and its request takes the arguments from it; its tracer would
    decode the body again, and so would this pool. The body decoded already when no content
    type is given (Celery converted an older protocol's message)."""
    if not content_type:
        return body
    request = getattr(accept_callback, "__self__", None)
    message = getattr(request, "message", None)
    if message is None or getattr(message, "body", None) is not body:
        return None
    decoded = message.payload
    return decoded if isinstance(decoded, (list, tuple)) and len(decoded) == 3 else None


def _sends_events(accept_callback: Callable[..., Any]) -> bool:
    """Whether accepting the request sends Flower its task-started event (a write to the broker):
    Celery's `Request.on_accepted` does while the worker's events are on (`-E`, or enabled at
    run time by `celery control enable_events`); otherwise it only notes the request in the
    worker's state, which the loop does in place. Unknown callbacks count as sending."""
    request = getattr(accept_callback, "__self__", None)
    if request is None or not hasattr(request, "_eventer"):
        return True
    eventer = request._eventer
    return bool(eventer is not None and eventer.enabled and request.task.send_events)


@dataclass(eq=False)
class _Slot:
    """One delivery's slot: taken once (waiting while none is free, marked held meanwhile),
    accepted once (Celery's bookkeeping and Flower's task-started event), given back once, on the
    loop, whichever thread gives it back first."""

    pool: RolloutPool
    loop: asyncio.AbstractEventLoop
    slots: asyncio.Semaphore
    number: int
    request: dict[str, Any]
    accept_callback: Callable[..., Any] | None
    held: bool = field(default=False, init=False)
    done: bool = field(default=False, init=False)
    """Read and set on the loop only."""
    accepted: bool = field(default=False, init=False)
    refused: bool = field(default=False, init=False)
    """The worker began its warm stop before the slot was free: the delivery must not start."""
    lent: Any = field(default=None, init=False)
    """The consumer's QoS that lent this delivery a message of prefetch (`give_back`)."""

    async def take(self) -> bool:
        """Wait for a free slot, then accept the delivery; False if the warm stop came first."""
        pool = self.pool
        tag = None
        if pool._swept_broker is not None and self.slots.locked():
            tag = _delivery_tag(self.request)
        if tag is not None:  # taken ahead: it waits for a slot
            pool._waiting[self.number] = tag
            if pool._keeper is None or pool._keeper.done():
                pool._keeper = self.loop.create_task(pool._keep_held())
        try:
            await self.slots.acquire()
        finally:
            pool._waiting.pop(self.number, None)
        if pool._stopping:
            self.slots.release()
            self.refused = True
            return False
        self.held = True
        await self.accept()
        return True

    async def accept(self) -> None:
        """Run the delivery's accept callback, once."""
        accept_callback = self.accept_callback
        if self.accepted or accept_callback is None:
            self.accepted = True
            return
        self.accepted = True
        accepted = time.monotonic()
        if _sends_events(accept_callback):
            # The task-started event goes out before the task's own, off the loop.
            await self.pool._finishing.submit(
                self.loop, lambda: accept_callback(os.getpid(), accepted)
            )
        else:  # bookkeeping only: no hop for it
            accept_callback(os.getpid(), accepted)

    def release(self, lend: bool = False) -> None:
        """Give the slot back (if taken), once; from any thread."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._release(lend)
        else:
            self.loop.call_soon_threadsafe(self._release, lend)

    def give_back(self) -> None:
        """The rollout's `/run` call ended (`CALL_ENDED`): its slot is given back while it lands,
        and the consumer may take one more message meanwhile, so that the next rollout is
        delivered for the freed slot. Taking deliveries ahead of free slots instead
        (`RolloutPool.ahead`) strands them behind busy slots when the queue runs dry, while
        another worker's slots are free."""
        self.release(lend=True)

    def _release(self, lend: bool = False) -> None:
        if self.held and not self.done:
            self.done = True
            self.slots.release()
            if lend:
                self.lent = self.pool.lend()


class PrefetchAhead(bootsteps.StartStopStep):  # type: ignore[misc]  # celery's bootsteps are untyped
    """A consumer step: a rollout pool's worker takes deliveries for the slots its landing
    rollouts gave back, and `RolloutPool.ahead` beyond its slots if set.

    With late acknowledgement and a prefetch of one message per slot, a slot freed when a
    rollout's `/run` call ends could be refilled only after that rollout landed, was settled
    and acknowledged, and the next claim came back: when thousands of replies arrived together,
    the next rollouts started seconds after the slots were free. So the pool lends the
    consumer's prefetch a message for each slot given back while its rollout lands (up to
    `RolloutPool.lend_cap`), and takes it back once the rollout landed. A standing number taken
    ahead (`ROLLOUTS_PREFETCH_AHEAD`, none by default) does the same for a full worker, but its
    deliveries wait behind busy slots when the queue runs dry, while another worker's slots are
    free: at 4,096 in flight the last of them started a whole agent latency late. Celery sizes
    the consumer's prefetch by `-c` at first and by the pool's `num_processes` afterwards; this
    makes the first agree. The caps still hold: a delivery waits for a slot, then for admission.
    """

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        if isinstance(parent.pool, RolloutPool):
            parent.pool.consumer = parent
            if parent.initial_prefetch_count:
                parent.initial_prefetch_count = parent.max_prefetch_count
