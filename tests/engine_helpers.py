"""The worker side's unit-test harness: the rollout engine over its in-memory fakes
(`workers/rollout/fakes.py`) with an agent over `httpx.MockTransport`, and a rollout task's
message as kombu's Redis transport keeps it."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
from celery import Celery

from infra.http import EventLoopThread
from schemas import fields as F
from schemas.messages import QUEUE, Admission, CallPolicy, CollectRequest, RunRef
from schemas.outcomes import RolloutOutcome
from schemas.replies import RolloutReply
from workers.redispatch import CollectTaskMessage, publish_collect
from workers.replies import reply_body
from workers.rollout import (
    RECORDED,
    AgentCaller,
    Blocking,
    Delivery,
    RolloutContext,
    StopWatch,
    run_rollout,
    run_rollout_async,
)
from workers.rollout.context import SLOT
from workers.rollout.fakes import FakeFeeds, FakeGate, FakeLander, FakeLeases, FakeShard

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
ROW = {F.TASK_INDEX: 3, F.ROLLOUT_INDEX: 1, F.AGENT_REF: {"name": "a"}, "question": "1+1"}
# The agent's reply with the planned row's identity stamped on it.
RESULT = {"reward": 1.0, F.TASK_INDEX: 3, F.ROLLOUT_INDEX: 1, F.AGENT_REF: {"name": "a"}}


def loop_thread(name: str) -> Iterator[EventLoopThread]:
    """An event loop thread for a module's engine tests (a fixture yields from it), stopped and
    closed after them."""
    thread = EventLoopThread(name)
    yield thread
    thread.loop.call_soon_threadsafe(thread.loop.stop)
    thread.thread.join(5)
    thread.loop.close()


class Harness:
    """A shard, its fake gate and lander, and an agent answering with `handler`."""

    def __init__(self, loop: EventLoopThread) -> None:
        self.loop = loop
        self.shard = FakeShard()
        self.gate = FakeGate(self.shard)
        self.lander = FakeLander(self.shard)
        self.leases = FakeLeases(self.shard)
        self.requests: list[dict[str, Any]] = []
        self.handler: Handler = self.reply(200, {"reward": 1.0})
        self.slept: list[float] = []
        self.clients: list[httpx.AsyncClient] = []
        self.land_wait_s = 5.0
        self.refused_because: str | None = None
        self.checked: list[tuple[RunRef, str]] = []
        self.vouched_for: set[tuple[RunRef, str]] = set()
        self.row: dict[str, Any] = dict(ROW)
        """The planned row its rollouts run."""
        self.feeds: FakeFeeds | None = None
        """The rollouts' feed, when they have one (`feed=` of `run`)."""

    def refusal(self, run: RunRef, agent_url: str) -> str | None:
        """The manifest check (`RunCheck`): records what it was asked."""
        self.checked.append((run, agent_url))
        if self.refused_because is None:
            self.vouched_for.add((run, agent_url))
        return self.refused_because

    def vouched(self, run: RunRef, agent_url: str) -> bool:
        """As `ManifestCheck` keeps it: vouched for once a check said None."""
        return (run, agent_url) in self.vouched_for

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def reply(self, status: int, body: Any) -> Handler:
        async def answer(request: httpx.Request) -> httpx.Response:
            return httpx.Response(status, content=orjson.dumps(body))

        return answer

    def client(self) -> httpx.AsyncClient:
        async def record(request: httpx.Request) -> httpx.Response:
            self.requests.append(orjson.loads(request.content))
            return await self.handler(request)

        made = httpx.AsyncClient(transport=httpx.MockTransport(record))
        self.clients.append(made)
        return made

    def context(self) -> RolloutContext:
        return RolloutContext(
            gate=self.gate,
            lander=self.lander,
            agent=AgentCaller(self.client, StopWatch(self.gate.stop_reason, Blocking(), 0.01)),
            loop=self.loop,
            sleep=self.sleep,
            land_wait_s=self.land_wait_s,
            leases=self.leases,
            runs=self,
            feeds=self.feeds,
        )

    def run(
        self,
        delivery: Delivery = RECORDED,
        token: str = "token-1",
        slot: Callable[[], Awaitable[bool]] | None = None,
        **policy: Any,
    ) -> RolloutOutcome:
        """Run one delivery; `slot`: it was taken ahead of the pool's slots (`SLOT`)."""
        admission = policy.pop("admission", Admission())
        health = policy.pop("health", None)
        feed = policy.pop("feed", None)
        req = CollectRequest(
            run=RunRef(run_id="r", output_dir="/tmp/nowhere", shard="0", token=token),
            agent_url="http://agent",
            policy=CallPolicy(backoff_base_s=0.001, **policy),
            row=dict(self.row),
            admission=admission,
            health=health,
            feed=feed,
        )
        try:
            if slot is None:
                outcome = run_rollout(req, self.context(), delivery)
            else:
                outcome = self.loop.run(_with_slot(slot, req, self.context(), delivery))
            # Whatever path it took, the Python API's reply of it reads back as the outcome.
            assert replied(outcome) == outcome
            return outcome
        finally:
            for c in self.clients:
                self.loop.run(c.aclose())
            self.clients.clear()

    def slots_returned(self) -> bool:
        """Every admitted delivery gave its slot back and ended its delivery count."""
        return len(self.gate.released) == len(self.gate.admitted) and not self.shard.starts


async def _with_slot(
    slot: Callable[[], Awaitable[bool]], req: CollectRequest, ctx: RolloutContext, d: Delivery
) -> RolloutOutcome:
    """A delivery the pool took ahead of its slots: the engine awaits `slot` itself."""
    SLOT.set(slot)
    return await run_rollout_async(req, ctx, d)


def replied(outcome: RolloutOutcome) -> RolloutOutcome:
    """The outcome as the caller reads it from its reply (`workers/replies.py`'s encoding)."""
    return RolloutReply.model_validate_json(
        reply_body(RolloutReply(index=0, outcome=outcome))
    ).outcome


def limited(status: int = 429, retry_after: str | None = "2") -> Handler:
    async def answer(request: httpx.Request) -> httpx.Response:
        headers = {} if retry_after is None else {"Retry-After": retry_after}
        return httpx.Response(status, headers=headers, text="slow down")

    return answer


def replies(*handlers: Handler) -> Handler:
    it = iter(handlers)

    async def answer(request: httpx.Request) -> httpx.Response:
        return await next(it)(request)

    return answer


def as_kept(m: CollectTaskMessage) -> dict[str, Any]:
    """`m` as published, then as kombu's Redis transport keeps a delivered message."""
    app = Celery("t", set_as_current=False)
    sent: list[dict[str, Any]] = []

    class Producer:
        def publish(self, body: Any, **kw: Any) -> None:
            sent.append({"body": body, **kw})

    publish_collect(app, Producer(), app.amqp.queues[QUEUE], m)
    app.close()
    [out] = sent
    return {
        "headers": out["headers"],
        "properties": {"body_encoding": "base64"},
        "body": base64.b64encode(json.dumps(out["body"]).encode()).decode(),
    }
