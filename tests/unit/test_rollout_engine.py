"""The rollout engine through every way a rollout ends, over in-memory fakes and httpx.MockTransport.

No Redis, no storage, no worker process: the gate and lander are `workers/rollout/fakes.py`, the
agent is an `httpx.AsyncClient` over a `MockTransport` driven by the real `call_run`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from infra.http import EventLoopThread
from schemas import fields as F
from schemas.errors import StorageError
from schemas.messages import Admission, CallPolicy, CollectRequest, HealthRef, RunRef
from schemas.outcomes import Ended, RolloutOutcome
from schemas.replies import RolloutReply, admission_row
from tests.engine_helpers import RESULT, ROW, Handler, Harness, limited, loop_thread, replies
from workers.replies import reply_body
from workers.rollout import (
    Delivery,
    run_rollout_async,
)
from workers.rollout.context import WaitingLines
from workers.rollout.encoding import RESULT_NOT_STORED
from workers.rollout.leases import Lease, LeaseTicket


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    yield from loop_thread("test-engine")


STAMPS = (F.STARTED_AT, F.RUN_MS, F.EXECUTION)


def untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without the stamps every landed record carries: its timing (`_ng_started_at`,
    `_ng_run_ms`) and its execution (`_ng_execution`)."""
    return [{k: v for k, v in r.items() if k not in STAMPS} for r in rows]


@pytest.fixture
def h(loop: EventLoopThread) -> Harness:
    return Harness(loop)


def test_landed(h: Harness) -> None:
    out = h.run()
    assert out.ended is Ended.LANDED and out.rollout == "3-1"
    # The landed row is the reply, stamped with when its /run started and how long it took.
    [landed] = h.shard.results
    started, run_ms = landed[F.STARTED_AT], landed[F.RUN_MS]
    assert untimed([landed]) == [RESULT] and h.shard.failures == []
    assert landed[F.EXECUTION] == {"generation": 0, "attempt": 0}  # no lease: no attempt
    assert isinstance(started, float) and 0 <= run_ms <= 60_000
    assert out.record is not None and out.record[F.RUN_MS] == run_ms
    assert out.requests == 1 and out.run_ms is not None
    assert h.gate.freed == ["3:1"] and h.slots_returned()
    assert h.gate.released[0].duration_s is None  # no budget: no duration kept
    assert out.chord_summary() == {"rollout": "3-1", "outcome": "landed", "requests": 1}


def test_a_landed_result_is_judged_and_counted_once(h: Harness) -> None:
    empty = {"reward": 0.0, "response": {"id": "r", "status": "completed", "output": []}}
    h.handler = h.reply(200, empty)
    out = h.run(health=HealthRef())
    # Its final response has no output (no call was captured): our empty check's finding.
    health = {"verdict": "unhealthy", "findings": {"rollout_response_empty": 1}}
    assert out.health == health
    assert out.chord_summary()["health"] == health  # the task's result (Flower)
    assert h.shard.health == {"unhealthy": 1, "issues:rollout_response_empty": 1}
    again = h.run(health=HealthRef())  # a redelivery lands nothing new: counted nothing
    assert again.ended is Ended.DUPLICATE and again.health is None
    assert h.shard.health == {"unhealthy": 1, "issues:rollout_response_empty": 1}


def test_no_live_verdict_without_the_runs_health_check(h: Harness) -> None:
    out = h.run()
    assert out.health is None and "health" not in out.chord_summary() and not h.shard.health


def test_landed_with_a_budget_records_its_duration(h: Harness) -> None:
    h.shard.budget_left_s = 100.0
    out = h.run(admission=Admission(dispatch_deadline=1e12))
    assert out.ended is Ended.LANDED
    duration = h.gate.released[0].duration_s
    assert duration is not None and duration >= 0


def test_identity_comes_from_the_planned_row_not_the_echo(h: Harness) -> None:
    h.handler = h.reply(200, {F.TASK_INDEX: 99, "reward": 0.0})
    out = h.run()
    assert out.ended is Ended.LANDED and h.shard.results[0][F.TASK_INDEX] == 3


def test_a_task_its_manifest_does_not_vouch_for_is_fenced_before_admission(h: Harness) -> None:
    h.refused_because = "the task names shard 0 of /tmp/nowhere, which has no readable manifest"
    out = h.run()
    assert out.ended is Ended.FENCED and out.detail == h.refused_because and out.record is None
    [(run, agent_url)] = h.checked
    assert run.token == "token-1" and agent_url == "http://agent"
    assert h.requests == [] and h.gate.admitted == [] and h.lander.calls == 0


def test_a_run_vouched_for_is_not_checked_again(h: Harness) -> None:
    """A process reads a shard's manifest once per run and agent: a later delivery of the run
    checks without leaving the event loop (`RunCheck.vouched`)."""
    assert h.run().ended is Ended.LANDED
    h.row = {**h.row, F.TASK_INDEX: 4}
    assert h.run().ended is Ended.LANDED
    assert len(h.checked) == 1 and sorted(h.gate.admitted) == ["3:1", "4:1"]


def task_request(task: int) -> CollectRequest:
    """The harness's request of the row with task index `task` (several rollouts of one run)."""
    return CollectRequest(
        run=RunRef(run_id="r", output_dir="/tmp/nowhere", shard="0", token="token-1"),
        agent_url="http://agent",
        policy=CallPolicy(),
        row={**ROW, F.TASK_INDEX: task},
    )


def test_rollouts_starting_together_are_admitted_in_one_round_trip(h: Harness) -> None:
    """The first tries at admission of the deliveries that start together go in one gathered
    round trip (`RolloutContext.admits`), each rollout still with its own ticket."""
    ctx = h.context()

    async def together() -> list[RolloutOutcome]:
        return await asyncio.gather(*(run_rollout_async(task_request(t), ctx) for t in range(6)))

    outcomes = h.loop.run(together())
    assert [o.ended for o in outcomes] == [Ended.LANDED] * 6
    assert sorted(h.gate.admitted) == [f"{t}:1" for t in range(6)]
    assert sum(h.gate.rounds) == 6 and len(h.gate.rounds) < 6, h.gate.rounds
    assert h.slots_returned()


def test_an_unrecorded_call_is_not_checked_against_a_manifest(h: Harness) -> None:
    h.refused_because = "never asked"
    out = h.run(Delivery(record=False, fails_run=False))
    assert out.ended is Ended.LANDED and h.checked == [] and h.lander.calls == 0


def test_duplicate_at_admission_calls_nobody(h: Harness) -> None:
    h.shard.landed.add("3:1")
    out = h.run()
    assert out.ended is Ended.DUPLICATE and out.record is None
    assert h.requests == [] and h.lander.calls == 0 and h.gate.admitted == []


def test_duplicate_at_landing_when_another_delivery_landed_meanwhile(h: Harness) -> None:
    async def racing(request: httpx.Request) -> httpx.Response:
        h.shard.landed.add("3:1")  # the other delivery lands while this one calls
        return httpx.Response(200, json={"reward": 0.5})

    h.handler = racing
    out = h.run()
    assert out.ended is Ended.DUPLICATE and h.shard.results == []
    assert out.record is not None and out.record["reward"] == 0.5
    assert h.slots_returned()


def test_fenced_at_admission(h: Harness) -> None:
    out = h.run(token="old-token")
    assert out.ended is Ended.FENCED and h.requests == [] and h.lander.calls == 0
    assert out.detail is not None and "opened by another writer" in out.detail


def test_fenced_at_landing_writes_nothing(h: Harness) -> None:
    async def reopened(request: httpx.Request) -> httpx.Response:
        h.shard.opener = "token-2"  # a resume opened the shard while the call ran
        return httpx.Response(200, json={"reward": 1.0})

    h.handler = reopened
    out = h.run()
    assert out.ended is Ended.FENCED and h.shard.results == [] and h.slots_returned()


def test_drained_by_the_budget(h: Harness) -> None:
    h.shard.budget_left_s = 0.0
    out = h.run()
    assert out.ended is Ended.DRAINED and h.requests == []
    assert out.record == {
        F.TASK_INDEX: 3,
        F.ROLLOUT_INDEX: 1,
        F.AGENT_REF: {"name": "a"},
        F.FAILURE_CLASS: "cancelled",
        F.NO_PERSIST: True,
        F.DISPATCH_DRAINED: True,
        "error_message": "not dispatched: dispatch budget exhausted",
    }
    assert out.chord_summary()["row"] == out.record


def test_drained_below_the_margin_names_it(h: Harness) -> None:
    h.shard.budget_left_s, h.shard.margin_s = 5.0, 12.0
    out = h.run()
    assert out.ended is Ended.DRAINED and out.record is not None
    assert out.record["error_message"] == (
        "not dispatched: 5s left in dispatch budget, below the 12s drain margin"
    )


@pytest.mark.parametrize(
    ("failed", "cancel", "message"),
    [
        (
            "rollout 1-0 failed: boom",
            None,
            "not dispatched: the run failed: rollout 1-0 failed: boom",
        ),
        (None, "cancel", "not dispatched: the run is cancelled"),
        (None, "drain", "not dispatched: the run is draining"),
    ],
)
def test_stopped_by_a_failed_or_cancelled_run(
    h: Harness, failed: str | None, cancel: str | None, message: str
) -> None:
    h.shard.run_failed, h.shard.cancel = failed, cancel
    out = h.run()
    assert out.ended is Ended.STOPPED and h.requests == [] and h.shard.failures == []
    assert out.record is not None and out.record["error_message"] == message
    assert out.chord_summary()["outcome"] == "stopped"


def test_cancelled_in_flight_cuts_the_call(h: Harness) -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        h.shard.cancel = "cancel"
        await asyncio.sleep(30)
        return httpx.Response(200, json={})

    h.handler = slow
    out = h.run()
    assert out.ended is Ended.CANCELLED and out.detail == "cancel"
    assert h.lander.calls == 0 and h.gate.released[0].field == "cancelled" and h.slots_returned()


def test_a_drain_lets_the_call_in_flight_finish(h: Harness) -> None:
    async def draining(request: httpx.Request) -> httpx.Response:
        h.shard.cancel = "drain"
        await asyncio.sleep(0.05)
        return httpx.Response(200, json={"reward": 1.0})

    h.handler = draining
    assert h.run().ended is Ended.LANDED


def test_failed_after_retries_fails_the_run(h: Harness) -> None:
    h.handler = h.reply(502, {"detail": "bad gateway"})  # 503 is backpressure (issue 16)
    out = h.run(max_attempts=3)
    assert out.ended is Ended.FAILED and out.requests == 3 and len(h.requests) == 3
    assert [f.get(F.ATTEMPT_INDEX) for f in h.shard.failures] == [None, 1, 2]
    assert out.record == h.shard.failures[-1]
    assert h.shard.run_failed is not None and h.shard.run_failed.startswith("rollout 3-1 failed: ")


def test_failed_routed_to_the_sidecar_leaves_the_run_going(h: Harness) -> None:
    h.handler = h.reply(500, {"detail": "bug"})
    out = h.run(route_failures_to_sidecar=True)
    assert out.ended is Ended.FAILED and h.shard.run_failed is None
    assert h.shard.failures[0][F.FAILURE_CLASS] == "agent_run_error"


def test_the_python_api_never_fails_the_run(h: Harness) -> None:
    h.handler = h.reply(500, {"detail": "bug"})
    out = h.run(Delivery(fails_run=False))
    assert out.ended is Ended.FAILED and h.shard.run_failed is None


def test_agent_chosen_failure(h: Harness) -> None:
    h.handler = h.reply(200, {F.FAILURE_CLASS: "judge_failed", "reward": 0.0})
    out = h.run()
    assert out.ended is Ended.AGENT_FAILURE and h.shard.results == []
    assert h.shard.failures[0][F.FAILURE_CLASS] == "judge_failed"
    assert h.shard.run_failed is None  # the agent's own failure row is evidence, not a run error


def test_not_persisted(h: Harness) -> None:
    h.handler = h.reply(200, {F.NO_PERSIST: True})
    out = h.run()
    assert out.ended is Ended.NOT_PERSISTED and h.shard.results == [] and h.shard.failures == []
    assert "3:1" not in h.shard.landed and h.slots_returned()


def test_worker_lost_after_the_attempt_limit(h: Harness) -> None:
    h.shard.starts["3:1"] = 2  # two deliveries started and never ended: their workers died
    out = h.run(max_attempts=2)
    assert out.ended is Ended.WORKER_LOST and h.requests == []
    assert h.shard.failures == [out.record]
    assert out.record is not None and out.record[F.FAILURE_CLASS] == "worker_lost"
    assert h.shard.run_failed is not None  # not routed: a lost rollout fails the run


def test_a_row_without_identity_replies_without_a_rollout_id(h: Harness) -> None:
    # A row given to run_examples as is: no task or rollout index, so no rollout id. Its reply
    # leaves the id out, and the caller reads it back whole (it once failed to, and the
    # caller's only listener died on it).
    h.row = {F.AGENT_REF: {"name": "a"}, "question": "1+1"}
    run = RunRef(run_id="r", output_dir="/tmp/nowhere", shard="0", token="token-1")
    seen = CollectRequest(run=run, agent_url="http://agent",
                          row=admission_row(h.row, {"invocation": "i", "index": 4}))  # fmt: skip
    out = h.run(Delivery(record=False, fails_run=False, admission=seen))
    assert out.rollout is None and out.ended is Ended.LANDED
    assert '"rollout"' not in reply_body(RolloutReply(index=4, outcome=out))


def test_worker_lost_unrecorded_lands_nothing(h: Harness) -> None:
    h.shard.starts["3:1"] = 1
    out = h.run(Delivery(record=False, fails_run=False), max_attempts=1)
    assert out.ended is Ended.WORKER_LOST and h.lander.calls == 0 and h.shard.run_failed is None


def test_unrecorded_delivery_returns_the_result_and_writes_nothing(h: Harness) -> None:
    admitted: list[bool] = []
    out = h.run(Delivery(record=False, fails_run=False, on_admitted=lambda: admitted.append(True)))
    assert out.ended is Ended.LANDED and out.record == RESULT
    assert h.lander.calls == 0 and admitted == [True] and h.slots_returned()


def test_landing_rides_out_a_redis_restart(h: Harness) -> None:
    h.lander.errors = [redis.ConnectionError("restarting"), redis.ConnectionError("restarting")]
    out = h.run()
    assert out.ended is Ended.LANDED and h.lander.calls == 3 and h.slept == [0.5, 1.0]


def test_a_summary_delivery_lets_its_result_go_and_a_retry_reuses_the_encoded_records(
    h: Harness,
) -> None:
    """`rollouts run`'s task returns a summary: the parsed result is not kept in the outcome,
    and a landing retried after a Redis restart queues the records encoded the first time."""
    encoded: list[Any] = []
    encode = h.lander.encode

    def counting(result: Any, failures: Any) -> Any:
        encoded.append(result)
        return encode(result, failures)

    h.lander.encode = counting  # type: ignore[method-assign]
    h.lander.errors = [redis.ConnectionError("restarting")]
    out = h.run(Delivery(returns_record=False))
    assert out.ended is Ended.LANDED and out.record is None
    assert h.lander.calls == 2 and len(encoded) == 1
    assert untimed(h.shard.results) == [RESULT]
    # The Python API's default keeps it: its reply carries the result.
    kept = Harness(h.loop).run().record
    assert kept is not None and untimed([kept]) == [RESULT]


def test_the_encoded_records_are_let_go_once_landed(h: Harness) -> None:
    """A rollout keeps its encoded lines (a result's is its whole reply) only until they are
    down: not while it settles its lease and waits for Celery's tracer, which a wave of
    thousands of replies makes wait behind the next rollouts' starts."""
    encoded: list[weakref.ref[Any]] = []
    encode = h.lander.encode

    def kept(result: Any, failures: Any) -> Any:
        records = encode(result, failures)
        encoded.append(weakref.ref(records))
        return records

    alive_at_settle: list[bool] = []
    settle = h.leases.settle

    def settling(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        alive_at_settle.append(encoded[0]() is not None)
        return settle(*args, **kwargs)

    h.lander.encode = kept  # type: ignore[method-assign]
    h.leases.settle = settling  # type: ignore[method-assign]
    out = h.run(Delivery(message={"task": "m"}, returns_record=False))
    assert out.ended is Ended.LANDED and untimed(h.shard.results) == [RESULT]
    assert alive_at_settle == [False]


def test_a_storage_error_is_an_error_outcome_and_frees_the_slot(h: Harness) -> None:
    h.lander.errors = [StorageError("disk full")]
    out = h.run()
    assert out.ended is Ended.ERROR and out.detail == "StorageError: disk full"
    assert h.shard.results == [] and h.slots_returned()
    assert out.chord_summary() == {
        "rollout": "3-1",
        "outcome": "error",
        "error": "StorageError: disk full",
        "requests": 1,
    }


def test_redis_down_at_admission_is_an_error_outcome(h: Harness) -> None:
    def down(req: CollectRequest, sid: str, readmit: Any = None) -> Any:
        raise redis.ConnectionError("no Redis")

    h.gate.admit = down  # type: ignore[method-assign]
    out = h.run()
    assert out.ended is Ended.ERROR and h.requests == []


def test_an_unexpected_error_is_an_outcome_not_an_exception(h: Harness) -> None:
    h.lander.errors = [RuntimeError("bug")]
    out = h.run()
    assert out.ended is Ended.ERROR and out.detail == "RuntimeError: bug"
    assert h.slots_returned()


def deep_reply(extra: dict[str, Any] | None = None) -> Handler:
    """An agent answering JSON nested 300 levels deep: it parses, and orjson cannot write it."""

    async def answer(request: httpx.Request) -> httpx.Response:
        body = orjson.dumps({"reward": 1.0, **(extra or {})})
        return httpx.Response(
            200, content=body[:-1] + b',"nested":' + b"[" * 299 + b"]" * 299 + b"}"
        )

    return answer


def test_a_result_that_cannot_be_stored_fails_alone_with_its_row(h: Harness) -> None:
    h.handler = deep_reply()
    out = h.run()
    assert out.ended is Ended.FAILED and h.shard.results == [] and "3:1" not in h.shard.landed
    assert h.shard.failures == [out.record] and out.record is not None
    assert out.record[F.EXECUTION] == {"generation": 0, "attempt": 0}
    canonical = out.record[F.FAILURE_RECORD]
    assert (canonical["schema_version"], canonical["source"]) == (1, "collector")
    assert canonical["exception_type"] == "JSONEncodeError"
    assert {k: v for k, v in out.record.items() if k not in (F.EXECUTION, F.FAILURE_RECORD)} == {
        F.TASK_INDEX: 3,
        F.ROLLOUT_INDEX: 1,
        F.AGENT_REF: {"name": "a"},
        F.FAILURE_CLASS: RESULT_NOT_STORED,
        F.FAILURE_TYPE: "JSONEncodeError",
        F.FAILURE_MESSAGE: "the /run result could not be stored: it cannot be encoded as JSON: "
        "Recursion limit reached",
        F.FAILURE_HTTP_STATUS: None,
        F.FAILURE_RESPONSE_BODY: None,
    }
    assert h.shard.run_failed == (
        "rollout 3-1 failed: result_not_stored: the /run result could not be stored: "
        "it cannot be encoded as JSON: Recursion limit reached"
    )  # not routed: it fails the run, as any failed rollout does
    assert h.slots_returned()


def test_a_result_that_cannot_be_stored_routed_to_the_sidecar_leaves_the_run_going(
    h: Harness,
) -> None:
    h.handler = deep_reply({F.FAILURE_CLASS: "judge_failed"})  # the agent's own row, too deep
    out = h.run(route_failures_to_sidecar=True)
    assert out.ended is Ended.FAILED and h.shard.run_failed is None
    assert [f[F.FAILURE_CLASS] for f in h.shard.failures] == [RESULT_NOT_STORED]
    assert out.record == h.shard.failures[0]
    assert out.record is not None and "the failure row could not" in out.record[F.FAILURE_MESSAGE]


def test_a_lander_that_never_answers_is_an_error_within_the_bound(h: Harness) -> None:
    h.lander.stuck, h.land_wait_s = True, 0.05
    started = time.monotonic()
    out = h.run()
    assert time.monotonic() - started < 2
    assert out.ended is Ended.ERROR and h.lander.calls == 1 and h.slots_returned()
    assert out.detail == (
        "StorageError: landing did not finish within 0.05s; its records may land later"
    )
    # The wait gave up, the lander's future was left alone: its thread may still settle it.
    [pending] = h.lander.unanswered
    assert not pending.cancelled()


def test_a_rate_limit_is_waited_out_without_a_slot_or_an_attempt(h: Harness) -> None:
    h.handler = replies(limited(429), limited(503), h.reply(200, {"reward": 1.0}))
    out = h.run()
    assert out.ended is Ended.LANDED and out.requests == 3 and h.shard.failures == []
    assert F.ATTEMPT_INDEX not in h.shard.results[0]
    assert [F.ATTEMPT_INDEX in r for r in h.requests] == [False, False, False]
    # Each wait is the Retry-After, slept in steps that look at the stop flags.
    assert sum(h.slept) == pytest.approx(4.0) and max(h.slept) <= 0.5
    assert [(b.status, b.wait_s) for b in h.gate.backed_off] == [(429, 2.0), (503, 2.0)]
    # One start, two readmissions that counted none; the slot was given back for each wait.
    assert h.gate.admitted == ["3:1"] and h.gate.readmitted == ["3:1", "3:1"]
    assert h.slots_returned() and h.shard.in_flight == 0


def test_a_rate_limit_past_its_budget_fails_with_the_rate_limit_kind(h: Harness) -> None:
    h.handler = limited(429, "2")
    out = h.run(rate_limit_budget_s=5.0)
    assert out.ended is Ended.FAILED and out.requests == 3 and len(h.requests) == 3
    [row] = h.shard.failures
    assert row[F.FAILURE_CLASS] == "agent_request_failed"
    assert row["failure_kind"] == "rollouts:rate_limited"
    assert row[F.FAILURE_HTTP_STATUS] == 429
    assert "waited 4.0s over 2 waits" in row[F.FAILURE_MESSAGE]
    assert "rate_limit_budget_s=5s" in row[F.FAILURE_MESSAGE]
    assert [b.wait_s for b in h.gate.backed_off] == [2.0, 2.0, None]
    assert h.shard.run_failed is not None and "rate limited" in h.shard.run_failed
    assert h.slots_returned()


def test_a_rate_limit_keeps_the_attempt_of_a_replay_before_it(h: Harness) -> None:
    h.handler = replies(h.reply(502, {}), limited(429, "1"), h.reply(200, {"reward": 1.0}))
    out = h.run()
    assert out.ended is Ended.LANDED and out.requests == 3
    assert [r.get(F.ATTEMPT_INDEX) for r in h.requests] == [None, 1, 1]
    assert [f[F.FAILURE_HTTP_STATUS] for f in h.shard.failures] == [502]
    assert h.shard.results[0][F.ATTEMPT_INDEX] == 1


def test_a_cancel_during_a_rate_limit_wait_ends_it_cancelled(h: Harness) -> None:
    async def limit_then_cancel(request: httpx.Request) -> httpx.Response:
        h.shard.cancel = "cancel"
        return httpx.Response(429, headers={"Retry-After": "30"})

    h.handler = limit_then_cancel
    out = h.run()
    assert out.ended is Ended.CANCELLED and out.detail == "cancel"
    assert sum(h.slept) <= 0.5 and len(h.requests) == 1
    assert h.gate.released[-1].field == "cancelled" and h.slots_returned()


def test_a_drain_lets_a_rate_limited_rollout_finish(h: Harness) -> None:
    async def limit_then_drain(request: httpx.Request) -> httpx.Response:
        h.shard.cancel = "drain"
        return httpx.Response(429, headers={"Retry-After": "1"})

    h.handler = replies(limit_then_drain, h.reply(200, {"reward": 1.0}))
    assert h.run().ended is Ended.LANDED and h.slots_returned()


def test_a_rollout_landed_elsewhere_during_its_wait_gives_its_start_back(h: Harness) -> None:
    async def limit_then_land(request: httpx.Request) -> httpx.Response:
        h.shard.landed.add("3:1")
        return httpx.Response(429, headers={"Retry-After": "1"})

    h.handler = limit_then_land
    assert h.run().ended is Ended.DUPLICATE
    assert not h.shard.starts and h.shard.in_flight == 0


def test_the_window_shrinks_on_a_rate_limit_and_grows_on_success(h: Harness) -> None:
    h.shard.window = 20.0
    h.handler = replies(limited(429, "1"), h.reply(200, {"reward": 1.0}))
    h.run()
    assert h.shard.ssthresh == pytest.approx(14.0)
    assert h.shard.window == pytest.approx(14.0 + 1 / 14)


MESSAGE = {"task_id": "r.abc.3-1", "payload": {}, "argsrepr": "rollout=3-1"}
LEASED = Delivery(message=MESSAGE)
"""A delivery carrying its task message: it takes the rollout's lease."""


def test_a_leased_attempt_notes_its_stages_and_settles_its_lease(h: Harness) -> None:
    out = h.run(LEASED)
    assert out.ended is Ended.LANDED and untimed(h.shard.results) == [RESULT]
    assert h.leases.stages == [("3:1", "calling"), ("3:1", "landing")]
    assert h.leases.settled == {"3:1": "token-1"} and not h.leases.held
    assert h.slots_returned()


def test_a_copy_of_a_delivery_whose_lease_is_fresh_calls_nothing_and_is_no_death(
    h: Harness,
) -> None:
    h.leases.take("sid", "3:1", "token-1", MESSAGE)  # the live attempt, elsewhere
    out = h.run(LEASED)
    assert out.ended is Ended.REDELIVERED and out.detail == "running on fake:1"
    assert h.requests == [] and h.gate.admitted == [] and h.shard.starts == {}
    assert h.lander.calls == 0 and "3:1" in h.leases.held  # the live lease stands


def test_a_copy_of_a_settled_rollout_calls_nothing(h: Harness) -> None:
    assert h.run(LEASED).ended is Ended.LANDED
    again = h.run(LEASED)
    assert again.ended is Ended.REDELIVERED and again.detail == "settled already"
    assert len(h.requests) == 1 and h.gate.admitted == ["3:1"]


def test_an_older_generations_lease_does_not_hold_back_a_resume(h: Harness) -> None:
    h.leases.take("sid", "3:1", "token-0", MESSAGE)  # a frozen worker of the earlier generation
    assert h.run(LEASED).ended is Ended.LANDED


def test_an_attempt_taken_over_while_it_called_lands_nothing_and_counts_nothing(
    h: Harness,
) -> None:
    async def slow_then_taken_over(request: httpx.Request) -> httpx.Response:
        # The holder froze: its lease expired, a live process re-published the rollout and
        # the new delivery took the lease as a new attempt.
        h.leases.take_over("3:1")
        return httpx.Response(200, content=orjson.dumps({"reward": 1.0}))

    h.handler = slow_then_taken_over
    out = h.run(LEASED)
    assert out.ended is Ended.TAKEN_OVER and out.detail == "taken over; this attempt fenced"
    assert h.shard.results == [] and h.shard.failures == [] and h.lander.calls == 1
    assert h.leases.republished == [MESSAGE]
    assert h.leases.settled == {}  # the new attempt settles it
    assert h.slots_returned()


def test_a_finished_shard_takes_nothing_from_a_late_attempt(h: Harness) -> None:
    h.shard.closed = True
    out = h.run(LEASED)
    assert out.ended is Ended.FENCED and h.shard.results == []


def test_the_last_attempt_after_takeovers_lands_worker_lost(h: Harness) -> None:
    # Two holders died on it (their starts never ended); the third delivery may not call.
    h.shard.starts["3:1"] = 2
    out = h.run(LEASED, max_attempts=2)
    assert out.ended is Ended.WORKER_LOST and h.requests == []
    [lost] = h.shard.failures
    assert lost[F.FAILURE_CLASS] == "worker_lost" and "died 2 times" in lost[F.FAILURE_MESSAGE]
    assert h.leases.settled == {"3:1": "token-1"}


FINISH = {"task": "rollouts.finish", "options": {"task_id": "finish-r"}}


def counting(published: list[dict[str, Any]]) -> Delivery:
    """A run's delivery: it counts toward its generation's finish, published into `published`."""
    return Delivery(message=MESSAGE, finish=published.append)


def test_the_delivery_that_settles_a_generation_s_last_rollout_publishes_its_finish(
    h: Harness,
) -> None:
    published: list[dict[str, Any]] = []
    h.leases.generation = ("token-1", 2, FINISH)
    h.leases.settle(Lease("sid", "0:0", ""), "token-1", count=True)  # the other rollout, earlier
    out = h.run(counting(published))
    assert out.ended is Ended.LANDED and h.leases.counted == 2
    assert published == [FINISH] and h.leases.settled["3:1"] == "token-1"


def test_a_rollout_counts_once_however_often_it_is_delivered(h: Harness) -> None:
    published: list[dict[str, Any]] = []
    h.leases.generation = ("token-1", 2, FINISH)
    assert h.run(counting(published)).ended is Ended.LANDED
    again = h.run(counting(published))  # a copy the broker redelivered
    assert again.ended is Ended.REDELIVERED and h.leases.counted == 1 and published == []


def test_an_attempt_taken_over_counts_nothing_toward_the_finish(h: Harness) -> None:
    published: list[dict[str, Any]] = []
    h.leases.generation = ("token-1", 1, FINISH)

    async def taken_over(request: httpx.Request) -> httpx.Response:
        h.leases.take_over("3:1")
        return httpx.Response(200, content=orjson.dumps({"reward": 1.0}))

    h.handler = taken_over
    assert h.run(counting(published)).ended is Ended.TAKEN_OVER
    assert h.leases.counted == 0 and published == []


def test_an_older_generation_s_rollout_counts_nothing_toward_this_one_s_finish(
    h: Harness,
) -> None:
    published: list[dict[str, Any]] = []
    h.leases.generation = ("token-2", 1, FINISH)  # a resume opened a new generation
    assert h.run(counting(published)).ended is Ended.LANDED  # token-1's delivery
    assert h.leases.counted == 0 and published == []


def test_a_delivery_that_could_take_no_lease_still_counts_once(h: Harness) -> None:
    published: list[dict[str, Any]] = []
    h.leases.generation = ("token-1", 1, FINISH)
    take = h.leases.take

    def redis_away(*args: Any) -> LeaseTicket:
        raise redis.ConnectionError("Redis is restarting")

    h.leases.take = redis_away  # type: ignore[method-assign,assignment]
    assert h.run(counting(published)).ended is Ended.LANDED
    assert h.leases.counted == 1 and published == [FINISH]
    h.leases.take = take  # type: ignore[method-assign]
    again = h.run(counting(published))
    assert again.ended is Ended.REDELIVERED and h.leases.counted == 1


def test_a_rollout_waits_on_the_loop_while_the_caps_are_full_then_lands(h: Harness) -> None:
    h.gate.full = 3
    out = h.run()
    assert out.ended is Ended.LANDED and len(h.shard.results) == 1
    # Three pauses between tries, each taken on the event loop (the context's sleep), none on
    # a thread; the slot was taken once and given back.
    assert len(h.slept) == 3 and all(0 < s <= 0.25 for s in h.slept)
    assert h.gate.admitted == ["3:1"] and h.slots_returned()
    # Every try after the first names the waiting entry the first one listed.
    assert h.gate.waited == [None, "fake|3:1", "fake|3:1"]


def _waiting_rollouts(
    h: Harness, n: int, full_s: float, refresh_s: float
) -> list[tuple[str, bool]]:
    """`n` rollouts of one shard and agent started at once in one context, admission full for
    `full_s` (real pauses): the tries made while it was full, as (rollout, whether it was a
    first try)."""
    tries: list[tuple[str, bool]] = []
    full = True
    try_admit = h.gate.try_admit

    def gate_try(req: CollectRequest, sid: str, readmit: Any = None, waiting: Any = None) -> Any:
        if full:
            tries.append((key_of(req), waiting is None))
            h.gate.full = 1
        return try_admit(req, sid, readmit, waiting)

    h.gate.try_admit = gate_try  # type: ignore[method-assign]
    ctx = dataclasses.replace(h.context(), sleep=asyncio.sleep, lines=WaitingLines(refresh_s))

    async def scenario() -> list[RolloutOutcome]:
        nonlocal full
        runs = [asyncio.ensure_future(run_rollout_async(task_request(t), ctx)) for t in range(n)]
        await asyncio.sleep(full_s)
        full = False
        return await asyncio.gather(*runs)

    outcomes = h.loop.run(scenario())
    assert [o.ended for o in outcomes] == [Ended.LANDED] * n
    assert h.slots_returned() and ctx.lines.empty
    return tries


def key_of(req: CollectRequest) -> str:
    return f"{req.row[F.TASK_INDEX]}:{req.row[F.ROLLOUT_INDEX]}"


def test_rollouts_waiting_for_a_slot_take_turns_asking_for_one(h: Harness) -> None:
    """Only the first in a process's line asks again while the caps stay full: 1,000 rollouts
    waiting out an agent's slow start must not each call the begin script every 20-250 ms."""
    tries = _waiting_rollouts(h, 5, full_s=0.5, refresh_s=10.0)
    firsts = [k for k, first in tries if first]
    again = [k for k, first in tries if not first]
    assert sorted(firsts) == [f"{t}:1" for t in range(5)]
    # Pauses of 10-250 ms over half a second: several tries again, every one by the first in line.
    assert len(again) >= 3 and set(again) == {"0:1"}
    # Once the caps opened, each landed (above), the next in line asking as the one before left.


def test_a_rollout_behind_others_in_line_still_asks_every_refresh(h: Harness) -> None:
    """Its waiting entry (`rollouts status`, stall detection) expires unless it asks again."""
    tries = _waiting_rollouts(h, 3, full_s=0.5, refresh_s=0.1)
    again = {k for k, first in tries if not first}
    assert again == {"0:1", "1:1", "2:1"}


def test_a_line_passes_the_turn_in_order_and_rings_its_first(loop: EventLoopThread) -> None:
    lines = WaitingLines()
    key = ("shard", "http://agent")

    async def scenario() -> list[str]:
        seen: list[str] = []
        left = asyncio.Event()

        async def stand(name: str, leave_after: asyncio.Event | None = None) -> None:
            async with lines.joined(key) as turn:
                if leave_after is not None:  # leaves from behind, before its turn
                    await leave_after.wait()
                    seen.append(f"{name} left")
                    return
                await turn
                seen.append(name)
                await asyncio.sleep(0)

        first = asyncio.ensure_future(stand("a"))
        behind = [asyncio.ensure_future(stand("b")), asyncio.ensure_future(stand("c", left))]
        behind.append(asyncio.ensure_future(stand("d")))
        await asyncio.sleep(0)
        assert lines.waiting(key) == 4
        bell = lines.bell(key)
        lines.ring(key)
        assert bell.done() and not lines.bell(key).done()
        left.set()
        lines.bell(key)  # the first waits on the bell again: it goes with the line
        await asyncio.gather(first, *behind)
        assert lines.waiting(key) == 0 and lines.empty
        return seen

    assert loop.run(scenario()) == ["a", "c left", "b", "d"]


class SlotAfter:
    """A pool slot that is given once `then` ran (it sees the world as the delivery waits)."""

    def __init__(self, then: Callable[[], object] = lambda: None, free: bool = True) -> None:
        self.then = then
        self.free = free
        self.awaited = 0

    async def __call__(self) -> bool:
        self.awaited += 1
        self.then()
        return self.free


def test_a_delivery_taken_ahead_waits_for_its_slot_holding_its_lease(h: Harness) -> None:
    held: list[str] = []
    slot = SlotAfter(lambda: held.extend(h.leases.held))
    out = h.run(LEASED, slot=slot)
    assert out.ended is Ended.LANDED and slot.awaited == 1
    assert held == ["3:1"] and h.gate.admitted == ["3:1"]  # leased while it waited, then admitted
    assert h.leases.settled == {"3:1": "token-1"} and h.slots_returned()


def test_a_copy_taken_ahead_ends_without_waiting_for_a_slot(h: Harness) -> None:
    h.leases.take("sid", "3:1", "token-1", MESSAGE)  # the live attempt, elsewhere
    slot = SlotAfter()
    out = h.run(LEASED, slot=slot)
    assert out.ended is Ended.REDELIVERED and slot.awaited == 0 and h.requests == []


def test_a_delivery_refused_its_slot_gives_its_lease_back_and_calls_nothing(h: Harness) -> None:
    out = h.run(LEASED, slot=SlotAfter(free=False))
    assert out.ended is Ended.REDELIVERED and "stopping" in (out.detail or "")
    assert h.leases.given_back == ["3:1"] and not h.leases.held and h.leases.settled == {}
    assert h.requests == [] and h.gate.admitted == []


def test_a_delivery_taken_over_while_it_waited_for_its_slot_calls_nothing(h: Harness) -> None:
    # Its worker froze with it waiting: its lease expired and the rollout runs elsewhere.
    out = h.run(LEASED, slot=SlotAfter(lambda: h.leases.take_over("3:1")))
    assert out.ended is Ended.TAKEN_OVER and h.requests == [] and h.gate.admitted == []
    assert h.shard.results == [] and h.leases.settled == {}
