"""The rollout pool without a broker: deliveries handed to it as Celery's worker hands them.

`on_apply` gets what `Request.execute_using_pool` passes (the tracer, the task's type, id,
request headers, body and content type); here the tracer is a stand-in that reads what the
delivery's coroutine left, as the rollout tasks' bodies do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import orjson
from celery import Celery
from celery.app.task import Context

from workers.pool import RolloutPool, on_loop, take_ran

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
