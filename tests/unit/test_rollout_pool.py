"""The rollout pool without a broker: deliveries handed to it as Celery's worker hands them.

`on_apply` gets what `Request.execute_using_pool` passes (the tracer, the task's type, id,
request headers, body and content type); here the tracer is a stand-in that reads what the
delivery's coroutine left, as the rollout tasks' bodies do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import orjson
import pytest
from celery import Celery
from celery.app.task import Context
from kombu.common import QoS

from infra.environment import from_env
from workers.pool import RequestView, RolloutPool, on_loop, take_ran
from workers.rollout.context import CALL_ENDED, SLOT

TASK = "tests.pooled"
seen: list[Any] = []


@on_loop(TASK)
async def _pooled(request: Any, value: str) -> dict[str, Any]:
    seen.append(request)
    await asyncio.sleep(0.05 if value == "slow" else 0)
    if value == "boom":
        raise RuntimeError("boom")
    return {"value": value, "chord": request.chord, "delivery": request.rollouts_delivery}


def _deliver(pool: RolloutPool, task_id: str, value: str) -> concurrent.futures.Future[Any]:
    """Hand the pool one delivery; the future settles with what the tracer stand-in returned."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    body = orjson.dumps([[value], {}, {"chord": {"task": "finish"}, "callbacks": None}])
    headers = {"id": task_id, "task": TASK, "group": "g1"}

    def tracer(name: str, uuid: str, request: dict[str, Any], *_: Any) -> Any:
        try:
            return take_ran(Context(request))
        except RuntimeError as exc:
            return f"raised {exc}"

    pool.apply_async(
        tracer,
        args=(TASK, task_id, headers, body, "application/json", "utf-8"),
        callback=done.set_result,
        accept_callback=lambda pid, at: None,
    )
    return done


def test_each_delivery_runs_its_coroutine_then_the_tracer_with_its_value() -> None:
    app = Celery("test-pool")
    pool = RolloutPool(limit=4, app=app)
    pool.start()
    try:
        # Two copies of one message at once (a redelivery while the first runs) and a failure.
        slow = _deliver(pool, "t-1", "slow")
        fast = _deliver(pool, "t-1", "fast")
        boom = _deliver(pool, "t-2", "boom")
        got = [f.result(5) for f in (slow, fast, boom)]
    finally:
        pool.stop()
    assert got[0]["value"] == "slow" and got[1]["value"] == "fast"
    assert got[0]["delivery"] != got[1]["delivery"]
    # The coroutine's request is the tracer's: the headers and the chord the body embeds.
    assert got[0]["chord"] == {"task": "finish"} and seen[0].group == "g1"
    assert got[2] == "raised boom"
    # Nothing is left behind for a later delivery to take.
    assert take_ran(Context({"id": "t-1", "rollouts_delivery": got[0]["delivery"]})) is None


def test_the_coroutine_reads_the_request_as_celery_s_context_without_a_copy() -> None:
    request: dict[str, Any] = {"id": "t-1", "group": "g1", "chord": None, "traceparent": "00-ab"}
    embed = {"chord": {"task": "finish"}, "callbacks": None}
    view, context = RequestView(request, embed), Context({**request, **embed})
    for name in ("id", "group", "chord", "callbacks", "traceparent", "retries", "reply_to"):
        assert getattr(view, name) == getattr(context, name), name
    assert getattr(view, "no_such_field", "absent") == "absent"
    request["rollouts_delivery"] = 7  # marked in place by the pool: the view reads it
    assert view.rollouts_delivery == 7
    assert RequestView(request, None).chord is None


class _Request:
    """What `_sends_events` reads of Celery's `Request`: its eventer and its task's flag."""

    def __init__(self, events: bool) -> None:
        self._eventer = type("Eventer", (), {"enabled": events})()
        self.task = type("Task", (), {"send_events": True})()
        self.accepted_on: list[str] = []

    def on_accepted(self, pid: int, at: float) -> None:
        import threading

        self.accepted_on.append(threading.current_thread().name)


def test_acceptance_hops_off_the_loop_only_when_it_sends_an_event() -> None:
    """Without task events, accepting a request is bookkeeping the loop does in place; with them
    (Flower's task-started) it runs on a finishing thread, before the coroutine starts."""
    app = Celery("test-pool-accept")
    pool = RolloutPool(limit=2, app=app)
    pool.start()
    try:
        for events, where in ((False, "rollouts-io"), (True, "rollouts-finish")):
            request = _Request(events)
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            body = orjson.dumps([["x"], {}, {"chord": None, "callbacks": None}])

            def tracer(*_: Any, request: _Request = request) -> Any:
                return list(request.accepted_on)

            pool.apply_async(
                tracer,
                args=(TASK, f"accept-{events}", {"id": "a", "task": TASK}, body,
                      "application/json", "utf-8"),
                callback=done.set_result,
                accept_callback=request.on_accepted,
            )  # fmt: skip
            [thread] = done.result(timeout=10)
            assert thread.startswith(where), (events, thread)
    finally:
        pool.stop()


PREFETCH_TASK = "tests.pooled_prefetch"
events: list[str] = []


@on_loop(PREFETCH_TASK)
async def _lands_slowly(request: Any, name: str, frees_slot: bool) -> str:
    """A rollout whose landing takes a while after its `/run` call: with `frees_slot`, it says
    its call ended (as the engine does, here from another thread) before landing."""
    events.append(f"{name} started")
    if frees_slot:
        hook = CALL_ENDED.get()
        assert hook is not None
        caller = threading.Thread(target=hook)
        caller.start()
        caller.join()
    for _ in range(200):  # landing: until the next delivery started, or 2 s
        if len(events) > 1 and events[-1] != f"{name} started":
            break
        await asyncio.sleep(0.01)
    events.append(f"{name} landed")
    return name


def _deliver_prefetch(
    pool: RolloutPool, name: str, frees_slot: bool
) -> concurrent.futures.Future[Any]:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    body = orjson.dumps([[name, frees_slot], {}, {"chord": None, "callbacks": None}])
    pool.apply_async(
        lambda *_: done.set_result(None),
        args=(PREFETCH_TASK, name, {"id": name, "task": PREFETCH_TASK}, body,
              "application/json", "utf-8"),
        accept_callback=lambda pid, at: None,
    )  # fmt: skip
    return done


@pytest.mark.parametrize("frees_slot", [True, False])
def test_a_slot_is_refilled_when_the_call_ends_not_when_the_rollout_landed(
    frees_slot: bool,
) -> None:
    """One slot: the delivery taken ahead starts as soon as the first says its `/run` call
    ended (`CALL_ENDED`), while the first still lands; without that, only after it landed."""
    events.clear()
    pool = RolloutPool(limit=1, app=Celery("test-pool-ahead"))
    pool.start()
    try:
        first = _deliver_prefetch(pool, "first", frees_slot)
        second = _deliver_prefetch(pool, "second", False)
        first.result(10)
        second.result(10)
    finally:
        pool.stop()
    if frees_slot:
        assert events[:3] == ["first started", "second started", "first landed"]
    else:
        assert events == ["first started", "first landed", "second started", "second landed"]


def test_the_prefetch_counts_the_slots_and_the_deliveries_taken_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Celery sizes the consumer's prefetch by `num_processes`: the slots by default,
    `ROLLOUTS_PREFETCH_AHEAD` more when set."""
    app = Celery("test-pool-count")
    try:
        for env, limit, ahead in ((None, 64, 0), (None, 2, 0), ("0", 64, 0), ("5", 64, 5)):
            if env is None:
                monkeypatch.delenv("ROLLOUTS_PREFETCH_AHEAD", raising=False)
            else:
                monkeypatch.setenv("ROLLOUTS_PREFETCH_AHEAD", env)
            from_env.cache_clear()
            pool = RolloutPool(limit=limit, app=app)
            assert (pool.ahead, pool.num_processes) == (ahead, limit + ahead), env
    finally:
        from_env.cache_clear()


LENDING_TASK = "tests.pooled_lending"
landed = threading.Event()


@on_loop(LENDING_TASK)
async def _gives_back(request: Any, name: str) -> str:
    """A rollout that says its `/run` call ended, then lands once `landed` is set."""
    hook = CALL_ENDED.get()
    assert hook is not None
    hook()
    while not landed.is_set():
        await asyncio.sleep(0.01)
    return name


class _Consumer:
    """The part of Celery's consumer the pool lends to: its QoS (kombu's, as Celery builds it)."""

    def __init__(self, prefetch: int) -> None:
        self.qos = QoS(lambda prefetch_count: None, prefetch)


def _values_while_landing(
    pool: RolloutPool, consumer: _Consumer, names: list[str], reconnect: bool = False
) -> tuple[list[int], int, int]:
    """Deliver `names` to `pool`, each giving its slot back and landing once `landed` is set:
    the prefetch while they land, then after they were acknowledged, and what Celery's
    consumer would apply meanwhile (`reconnect`: a new QoS before the acknowledgements)."""
    landed.clear()
    acknowledged = []
    for name in names:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        pool.apply_async(
            lambda *_: None,
            args=(LENDING_TASK, name, {"id": name, "task": LENDING_TASK},
                  orjson.dumps([[name], {}, {"chord": None, "callbacks": None}]),
                  "application/json", "utf-8"),
            callback=done.set_result,
            accept_callback=lambda pid, at: None,
        )  # fmt: skip
        acknowledged.append(done)
    deadline = time.monotonic() + 10
    while pool.lent < min(len(names), pool.lend_cap) and time.monotonic() < deadline:
        time.sleep(0.01)
    lent = [consumer.qos.value, pool.lent]
    old = consumer.qos
    if reconnect:
        consumer.qos = QoS(lambda prefetch_count: None, old.value - pool.lent)
    landed.set()
    for done in acknowledged:
        done.result(10)
    deadline = time.monotonic() + 10
    while pool.lent and time.monotonic() < deadline:
        time.sleep(0.01)
    return lent, consumer.qos.value, pool.lent


def test_a_slot_given_back_while_its_rollout_lands_lends_the_consumer_a_message() -> None:
    """The consumer may take one message more per slot given back until that rollout's message
    is acknowledged, at most `lend_cap` at once (a quarter of the slots): the freed slot's
    successor is delivered without holding deliveries ahead behind busy slots."""
    pool = RolloutPool(limit=8, app=Celery("test-pool-lend"))
    consumer = _Consumer(8)
    pool.consumer = consumer
    pool.start()
    try:
        assert pool.lend_cap == 2
        assert _values_while_landing(pool, consumer, ["a"]) == ([9, 1], 8, 0)
        assert _values_while_landing(pool, consumer, ["b", "c", "d"]) == ([10, 2], 8, 0)
        # A reconnection sizes the new QoS afresh: the acknowledgements after it lower nothing.
        assert _values_while_landing(pool, consumer, ["e"], reconnect=True) == ([9, 1], 8, 0)
    finally:
        landed.set()
        pool.stop()


HELD_TASK = "tests.pooled_held"
hold = threading.Event()


@on_loop(HELD_TASK)
async def _held(request: Any, name: str) -> str:
    events.append(f"{name} started")
    while not hold.is_set():
        await asyncio.sleep(0.01)
    events.append(f"{name} ended")
    return name


def _deliver_held(pool: RolloutPool, name: str) -> concurrent.futures.Future[Any]:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    body = orjson.dumps([[name], {}, {"chord": None, "callbacks": None}])
    pool.apply_async(
        lambda *_: done.set_result(None),
        args=(HELD_TASK, name, {"id": name, "task": HELD_TASK}, body, "application/json", "utf-8"),
        accept_callback=lambda pid, at: None,
    )
    return done


def test_a_warm_stop_finishes_what_holds_a_slot_and_starts_nothing_taken_ahead() -> None:
    """A warm stop returns once every delivery holding a slot ran its coroutine and its tracer;
    one still waiting for a slot then (taken ahead) is neither run nor finished: left
    unacknowledged, the broker gives it to another worker."""
    events.clear()
    hold.clear()
    pool = RolloutPool(limit=2, app=Celery("test-pool-stop"))
    pool.start()
    running = [_deliver_held(pool, name) for name in ("a", "b")]
    deadline = time.monotonic() + 5
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = _deliver_held(pool, "c")
    stopping = threading.Thread(target=pool.stop)
    stopping.start()
    while not pool._stopping and time.monotonic() < deadline:  # the warm stop has begun
        time.sleep(0.01)
    hold.set()  # a and b end; c gets a slot only now
    stopping.join(10)
    assert not stopping.is_alive()
    assert all(f.done() for f in running) and not waiting.done()
    assert sorted(events) == ["a ended", "a started", "b ended", "b started"]


def test_a_delivery_body_is_decoded_once_by_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's consumer decodes every message as it builds its request (kombu keeps the
    decode); the delivery's coroutine and Celery's tracer take that one instead of decoding the
    body twice more (a real `Request` of a real kombu `Message`, executed on the pool as the
    worker executes it)."""
    from celery.worker.request import Request
    from kombu.message import Message
    from kombu.serialization import loads as kombu_loads

    import workers.pool as pool_module

    decodes: list[bytes] = []

    def counted(body: Any, *args: Any, **kwargs: Any) -> Any:
        decodes.append(body)
        return kombu_loads(body, *args, **kwargs)

    monkeypatch.setattr("kombu.message.loads", counted)
    monkeypatch.setattr(pool_module, "loads_message", counted)
    app = Celery("test-pool-decode")

    def pooled(value: str) -> str:
        return value

    task = app.task(name=TASK, shared=False)(pooled)
    body = orjson.dumps([["once"], {}, {"chord": None, "callbacks": None}])
    message = Message(
        body=body,
        content_type="application/json",
        content_encoding="utf-8",
        headers={"id": "t-once", "task": TASK, "group": None},
        accept=["application/json"],
    )
    request = Request(message, app=app, task=task, hostname="h")
    traced: list[tuple[Any, ...]] = []
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def tracer(*args: Any) -> Any:
        traced.append(args)
        return take_ran(Context(args[2]))

    pool = RolloutPool(limit=2, app=app)
    pool.start()
    try:
        pool.apply_async(
            tracer,
            args=(
                TASK,
                request.id,
                request.request_dict,
                request.body,
                request.content_type,
                request.content_encoding,
            ),
            callback=done.set_result,
            accept_callback=request.on_accepted,
        )
        got = done.result(5)
    finally:
        pool.stop()
    assert got["value"] == "once"
    assert decodes == [body]  # the consumer's (Celery's request reads the payload), no other
    # The tracer is handed the decoded body with no content type: it decodes nothing.
    [(_, _, _, given, content_type, encoding)] = traced
    assert given == [["once"], {}, {"chord": None, "callbacks": None}]
    assert content_type is None and encoding is None


OWN_TASK = "tests.pooled_own_slot"
release = threading.Event()


@on_loop(OWN_TASK, own_slot=True)
async def _leases_first(request: Any, name: str) -> str:
    """A rollout task's shape: a first step (its lease) before its slot, then its call."""
    events.append(f"{name} leased")
    slot = SLOT.get()
    if slot is not None and not await slot():
        events.append(f"{name} refused")
        return "refused"
    events.append(f"{name} called")
    while not release.is_set():
        await asyncio.sleep(0.01)
    return name


def _deliver_own(pool: RolloutPool, name: str) -> tuple[concurrent.futures.Future[Any], list[str]]:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    accepted: list[str] = []
    body = orjson.dumps([[name], {}, {"chord": None, "callbacks": None}])
    pool.apply_async(
        lambda *_: done.set_result(events.count(f"{name} called")),
        args=(OWN_TASK, name, {"id": name, "task": OWN_TASK}, body, "application/json", "utf-8"),
        accept_callback=lambda pid, at: accepted.append(name),
    )
    return done, accepted


def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_delivery_taken_ahead_takes_its_lease_before_its_slot_is_free() -> None:
    """One slot, busy: the delivery taken ahead runs its first step (its rollout's lease) at once
    and is accepted (Flower's task-started) only once it has the slot."""
    events.clear()
    release.clear()
    pool = RolloutPool(limit=1, app=Celery("test-pool-own"))
    pool.start()
    try:
        first, _ = _deliver_own(pool, "a")
        _until(lambda: "a called" in events)
        second, accepted = _deliver_own(pool, "b")
        _until(lambda: "b leased" in events)
        assert events == ["a leased", "a called", "b leased"] and accepted == []
        release.set()
        assert first.result(5) == 1 and second.result(5) == 1 and accepted == ["b"]
    finally:
        pool.stop()


def test_a_warm_stop_refuses_the_slot_of_a_delivery_waiting_for_one_leased() -> None:
    """The delivery taken ahead learns it will not start (it gives its lease back) and is
    neither traced nor acknowledged: the broker gives it to another worker."""
    events.clear()
    release.clear()
    pool = RolloutPool(limit=1, app=Celery("test-pool-own-stop"))
    pool.start()
    running, _ = _deliver_own(pool, "a")
    _until(lambda: "a called" in events)
    waiting, accepted = _deliver_own(pool, "b")
    _until(lambda: "b leased" in events)
    stopping = threading.Thread(target=pool.stop)
    stopping.start()
    _until(lambda: pool._stopping)
    release.set()
    stopping.join(10)
    assert not stopping.is_alive() and running.done() and not waiting.done()
    assert events == ["a leased", "a called", "b leased", "b refused"] and accepted == []
