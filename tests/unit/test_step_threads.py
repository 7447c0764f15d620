"""The engine's step threads (`workers/rollout/context.py`): values, errors, context, cancels."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time

import pytest

from workers.rollout.context import Blocking, Gathered, StepThreads

WHO = contextvars.ContextVar("who", default="nobody")


@pytest.fixture(scope="module")
def threads() -> StepThreads:
    return StepThreads(4, "test-step")


def test_many_steps_come_back_with_their_own_values_off_the_loop(threads: StepThreads) -> None:
    blocking = Blocking(threads)
    loop_thread: list[threading.Thread] = []

    def step(i: int) -> tuple[int, str]:
        time.sleep(0.001 * (i % 3))
        return i, threading.current_thread().name

    async def main() -> list[tuple[int, str]]:
        loop_thread.append(threading.current_thread())
        return await asyncio.gather(*(blocking(functools.partial(step, i)) for i in range(500)))

    got = asyncio.run(main())
    assert [i for i, _ in got] == list(range(500))
    names = {name for _, name in got}
    assert names and all(n.startswith("test-step_") for n in names)
    assert loop_thread[0].name not in names


def test_a_step_s_error_is_raised_in_its_coroutine_and_it_sees_the_caller_s_context(
    threads: StepThreads,
) -> None:
    blocking = Blocking(threads)

    def fails() -> None:
        raise KeyError("boom")

    async def main() -> str:
        WHO.set("rollout 3-0")
        with pytest.raises(KeyError, match="boom"):
            await blocking(fails)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await blocking(lambda: next(iter(())))
        return await blocking(WHO.get)

    assert asyncio.run(main()) == "rollout 3-0"


def test_a_step_cancelled_before_it_started_does_not_run() -> None:
    one = StepThreads(1, "test-one")
    blocking = Blocking(one)
    started, ran = threading.Event(), []
    gate = threading.Event()

    def hold() -> None:
        started.set()
        gate.wait(5)

    async def main() -> None:
        held = asyncio.ensure_future(blocking(hold))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        queued = asyncio.ensure_future(blocking(lambda: ran.append(1)))
        await asyncio.sleep(0)
        queued.cancel()
        gate.set()
        await held
        with pytest.raises(asyncio.CancelledError):
            await queued
        await blocking(lambda: None)  # the thread has passed the cancelled step by now

    asyncio.run(main())
    assert ran == []


def test_without_threads_a_step_runs_inline() -> None:
    async def main() -> str:
        return await Blocking()(lambda: threading.current_thread().name)

    assert asyncio.run(main()) == threading.current_thread().name


def test_a_step_queued_first_runs_before_those_queued_earlier_without() -> None:
    """A rollout's start (`first=True`) does not wait behind the landings and settlings
    already queued: with the one thread busy, the steps then run first-queued first."""
    one = StepThreads(1, "test-first")
    busy = threading.Event()
    order: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        blocker = one.submit(loop, busy.wait)
        await asyncio.sleep(0.05)  # the thread is in the blocker now
        steps = [
            one.submit(loop, functools.partial(order.append, "settle a")),
            one.submit(loop, functools.partial(order.append, "settle b")),
            one.submit(loop, functools.partial(order.append, "start c"), first=True),
        ]
        busy.set()
        await asyncio.gather(blocker, *steps)

    asyncio.run(main())
    assert order == ["start c", "settle a", "settle b"]


def test_gathered_calls_made_while_a_step_runs_go_together_in_the_next(
    threads: StepThreads,
) -> None:
    batches: list[list[int]] = []
    release = threading.Event()

    def run_many(items: list[int]) -> list[int | Exception]:
        batches.append(items)
        if len(batches) == 1:
            release.wait(5)  # the first step holds while the others are called
        return [ValueError(f"no {i}") if i == 7 else i * 10 for i in items]

    gathered: Gathered[int, int] = Gathered(run_many, Blocking(threads), most=4)

    async def main() -> list[int | BaseException]:
        first = asyncio.ensure_future(gathered(0))
        await asyncio.sleep(0.05)  # the first step took call 0 alone and holds
        rest = [asyncio.ensure_future(gathered(i)) for i in range(1, 10)]
        await asyncio.sleep(0.05)
        rest[2].cancel()  # call 3, cancelled before a step took it: not run
        release.set()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    got = asyncio.run(main())
    assert batches == [[0], [1, 2, 4], [5, 6, 7, 8], [9]]  # at most 4 taken at a time
    assert got[:3] == [0, 10, 20] and isinstance(got[3], asyncio.CancelledError)
    assert got[4:7] == [40, 50, 60] and got[8:] == [80, 90]
    assert isinstance(got[7], ValueError) and str(got[7]) == "no 7"  # its own error, in its place


def test_a_gathered_step_that_raises_fails_each_of_its_calls_and_the_next_runs(
    threads: StepThreads,
) -> None:
    calls: list[list[str]] = []

    def run_many(items: list[str]) -> list[str | Exception]:
        calls.append(items)
        if "boom" in items:
            raise ConnectionError("Redis went away")
        return [s.upper() for s in items]

    gathered: Gathered[str, str] = Gathered(run_many, Blocking(threads))

    async def main() -> tuple[list[str | BaseException], str]:
        got = await asyncio.gather(gathered("a"), gathered("boom"), return_exceptions=True)
        return list(got), await gathered("c")

    got, after = asyncio.run(main())
    assert calls == [["a", "boom"], ["c"]]  # both called before the loop ran the step
    assert all(isinstance(g, ConnectionError) for g in got) and after == "C"
