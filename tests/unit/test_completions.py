"""The awaitables of `run_examples` (completion order, bounded start, close and drain) over a stub
transport, and how outcomes become results, errors and failure records."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from producer.api.calls import Call, _converter
from producer.api.completions import Completions, Settled
from producer.api.model import Outcome
from schemas import fields as F
from schemas.errors import PlanningError, RolloutFailedError, ShardFencedError
from schemas.finish import FinishResult
from schemas.outcomes import Ended, RolloutFailureRecord
from schemas.settings import CollectionSettings

ROWS = [{F.TASK_INDEX: i, F.ROLLOUT_INDEX: 0} for i in range(4)]


class StubTransport:
    """Records what the completions ask of it; outcomes are delivered by the test, from a thread."""

    def __init__(self) -> None:
        self.on_outcome: Callable[[Outcome], None] = lambda _: None
        self.finished: FinishResult | None = None
        self.started = 0
        self.stopped = False
        self.closed = 0
        self.during_close: list[Outcome] = []
        self.taken: list[int] = []

    def start(self) -> None:
        self.started += 1

    def stop_publishing(self) -> None:
        self.stopped = True

    def close(self) -> None:
        self.closed += 1
        for outcome in self.during_close:
            self.on_outcome(outcome)

    def consumed(self, index: int) -> None:
        self.taken.append(index)

    def deliver(self, *outcomes: Outcome) -> None:
        """Deliver from another thread, as the listener does."""

        def run() -> None:
            for outcome in outcomes:
                self.on_outcome(outcome)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()


def ok(i: int) -> Outcome:
    return Outcome(i, Ended.LANDED, {**ROWS[i], "reward": 1.0})


def plain(o: Outcome) -> Settled:
    if o.kind == "cancelled":
        return Settled(o.kind)
    return Settled(o.kind, value=(ROWS[o.index], o.result))


def make(bounded: bool = False, total: int = 4) -> tuple[Completions, StubTransport]:
    transport = StubTransport()
    return Completions(total, transport, plain, bounded), transport


def test_awaitables_resolve_in_completion_order_whichever_row() -> None:
    async def go() -> list[int]:
        completions, transport = make(total=3)
        futures = list(completions)
        waiting = asyncio.ensure_future(futures[0])
        await asyncio.sleep(0)
        transport.deliver(ok(2), ok(0), ok(1))
        first = await waiting
        rest = [await f for f in futures[1:]]
        await completions.aclose()
        return [row[F.TASK_INDEX] for row, _ in [first, *rest]]

    assert asyncio.run(go()) == [2, 0, 1]


def test_bounded_admission_starts_at_the_first_await_unbounded_at_the_first_next() -> None:
    async def go() -> tuple[int, int, int]:
        bounded, transport = make(bounded=True)
        future = next(bounded)
        before = transport.started
        transport.deliver(ok(1))
        await future
        unbounded, other = make()
        next(unbounded)
        await bounded.aclose()
        await unbounded.aclose()
        return before, transport.started, other.started

    before, after, unbounded = asyncio.run(go())
    assert (before, unbounded) == (0, 1)
    assert after >= 1


def test_aclose_cancels_waiters_stops_iteration_and_closes_once() -> None:
    async def go() -> None:
        completions, transport = make()
        futures = iter(completions)
        waiting = asyncio.ensure_future(next(futures))
        await asyncio.sleep(0)
        await completions.aclose()
        await completions.aclose()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(StopIteration):
            next(futures)
        assert transport.closed == 1 and transport.stopped
        assert await completions.aclose_and_drain() == []  # after aclose(): nothing

    asyncio.run(go())


def test_aclose_before_first_use_starts_nothing() -> None:
    async def go() -> StubTransport:
        completions, transport = make(bounded=True)
        await completions.aclose()
        return transport

    transport = asyncio.run(go())
    assert transport.started == 0 and transport.closed == 1


def test_drain_returns_unclaimed_settled_outcomes_once_without_those_the_close_cancelled() -> None:
    async def go() -> tuple[list[Any], list[Any], Any]:
        completions, transport = make()
        futures = iter(completions)
        first = next(futures)
        transport.deliver(ok(3), ok(1))
        claimed = await first  # claims row 3
        transport.during_close = [
            ok(0),
            Outcome(2, Ended.CANCELLED),
        ]  # 0 finished as the close began
        drained = await completions.aclose_and_drain()
        again = await completions.aclose_and_drain()
        return [await f for f in drained], again, claimed

    drained, again, claimed = asyncio.run(go())
    assert claimed[0][F.TASK_INDEX] == 3
    assert [row[F.TASK_INDEX] for row, _ in drained] == [1, 0]
    assert again == []


def test_a_drained_error_is_a_future_that_raises_it() -> None:
    def failing(o: Outcome) -> Settled:
        return Settled(o.kind, error=RolloutFailedError("boom", ROWS[o.index]))

    async def go() -> list[asyncio.Future[Any]]:
        transport = StubTransport()
        completions = Completions(2, transport, failing, bounded=False)
        next(completions)
        transport.deliver(Outcome(0, Ended.FAILED, {}))
        return await completions.aclose_and_drain()

    (future,) = asyncio.run(go())
    with pytest.raises(RolloutFailedError):
        future.result()


FAILURE = {
    F.TASK_INDEX: 1, F.ROLLOUT_INDEX: 0, F.ATTEMPT_INDEX: 2,
    F.FAILURE_CLASS: "agent_request_failed", F.FAILURE_TYPE: "ReadTimeout",
    F.FAILURE_MESSAGE: "timed out", F.FAILURE_KIND: "transport_timeout",
}  # fmt: skip


@pytest.mark.parametrize(
    ("route", "records", "expected"),
    [(False, False, RolloutFailedError), (True, False, dict), (True, True, RolloutFailureRecord)],
)
def test_a_failed_rollout_raises_or_resolves_per_options(
    route: bool, records: bool, expected: type
) -> None:
    settings = CollectionSettings(route_failures_to_sidecar=route)
    convert = _converter(ROWS, settings, Call(enrich=False, records=records), None, "api-x")
    settled = convert(Outcome(1, Ended.FAILED, FAILURE))
    if expected is RolloutFailedError:
        assert isinstance(settled.error, RolloutFailedError)
        assert settled.error.failure == FAILURE and settled.error.row is ROWS[1]
        assert "agent_request_failed: timed out" in str(settled.error)
        return
    assert settled.value is not None and settled.value[0] is ROWS[1]
    assert isinstance(settled.value[1], expected)


def test_failure_record_fields() -> None:
    record = RolloutFailureRecord.from_failure_row(FAILURE, "run-1", "row-1")
    assert record.episode_id.rollout_id == "1-0" and record.episode_id.attempt == 2
    assert (record.delivery, record.failure.failure_kind, record.failure.terminal) == (
        "possibly_delivered", "transport_timeout", False,
    )  # fmt: skip
    unreachable = {**FAILURE, F.FAILURE_KIND: "transport_unreachable", F.ROLLOUT_ID: "q7"}
    record = RolloutFailureRecord.from_failure_row(unreachable, "run-1", "row-1")
    assert (record.delivery, record.episode_id.rollout_id) == ("not_sent", "q7")
    bare = RolloutFailureRecord.from_failure_row({F.FAILURE_CLASS: "x"}, "run-1", "row-5")
    assert bare.episode_id.rollout_id == "row-5"


def test_enriched_results_carry_ng_perf() -> None:
    convert = _converter(ROWS, CollectionSettings(), Call(enrich=True, records=False), None, "x")
    perf = {"rollout_latency_ms": 12.5, "queue_wait_ms": 3.0}
    settled = convert(Outcome(0, Ended.LANDED, {"reward": 1.0}, perf=perf))
    assert settled.value is not None and settled.value[1]["ng_perf"] == perf


@pytest.mark.parametrize(
    ("kind", "raised"),
    [
        ("error", RolloutFailedError),
        ("fenced", ShardFencedError),
        ("cancelled", asyncio.CancelledError),
    ],
)
def test_system_errors_and_cancellation_propagate_even_from_run_outcomes(
    kind: str, raised: type[BaseException]
) -> None:
    settings = CollectionSettings(route_failures_to_sidecar=True)
    convert = _converter(ROWS, settings, Call(enrich=False, records=True), None, "x")
    settled = convert(Outcome(0, Ended(kind), error="the worker could not land it"))
    with pytest.raises(raised):
        settled.unwrap()


def test_options_left_at_their_defaults_keep_the_settings_values() -> None:
    from producer.api.calls import _settings

    base = {"max_resident_tasks": 8, "route_failures_to_sidecar": True, "rollout_timeout_s": 5}
    merged = _settings(base, max_resident_tasks=None, route_failures_to_sidecar=False)
    assert (merged.max_resident_tasks, merged.route_failures_to_sidecar) == (8, True)
    assert _settings(base, max_resident_tasks=2).max_resident_tasks == 2
    with pytest.raises(PlanningError, match="max_resident_tasks"):
        _settings(None, max_resident_tasks=0)


def test_an_outcome_that_cannot_be_converted_fails_its_row_alone() -> None:
    def picky(o: Outcome) -> Settled:
        if o.index == 1:
            raise KeyError("no such field")
        return plain(o)

    async def go() -> tuple[list[Any], list[int]]:
        transport = StubTransport()
        completions = Completions(3, transport, picky, bounded=False)
        futures = list(completions)
        transport.deliver(ok(0), ok(1), ok(2))  # on the listener's thread: it must not die
        got = await asyncio.gather(*futures, return_exceptions=True)
        await completions.aclose()
        return got, transport.taken

    got, taken = asyncio.run(go())
    errors = [g for g in got if isinstance(g, RolloutFailedError)]
    assert len(errors) == 1 and "row 1 cannot be read: KeyError" in str(errors[0])
    assert sorted(row[F.TASK_INDEX] for row, _ in [g for g in got if isinstance(g, tuple)]) == [
        0,
        2,
    ]
    assert sorted(taken) == [0, 1, 2]  # every outcome handed out, the error too


def test_a_row_past_its_result_timeout_raises_timeout_error_naming_it() -> None:
    convert = _converter(ROWS, CollectionSettings(), Call(enrich=False, records=False), None, "x")
    message = "rollout 2-0 has no outcome 5s after it was sent (result_timeout_s)"
    with pytest.raises(TimeoutError, match="rollout 2-0"):
        convert(Outcome(2, Ended.ERROR, error=message, timed_out=True)).unwrap()


def test_a_row_given_up_on_raises_with_its_cause() -> None:
    convert = _converter(ROWS, CollectionSettings(), Call(enrich=False, records=False), None, "x")
    cause = ConnectionError("Redis went away")
    settled = convert(Outcome(0, Ended.ERROR, error="the call's reply listener died", cause=cause))
    with pytest.raises(RolloutFailedError, match="listener died") as raised:
        settled.unwrap()
    assert raised.value.__cause__ is cause
