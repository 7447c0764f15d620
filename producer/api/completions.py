"""The caller's side of `run_examples`: awaitables that resolve in completion order, and the close.

Like `asyncio.as_completed`, the n-th awaitable handed out resolves to the n-th outcome to
settle, whichever row it belongs to. Outcomes arrive from the listener thread; they are handed
to the caller's event loop and given to waiting awaitables in the order those started waiting,
or kept until one is awaited. The close semantics follow NeMo Gym's `run_examples`:

- `aclose()` stops publishing, cancels what is unfinished and waits until nothing of the call
  runs any more; awaitables still waiting raise `CancelledError`, iteration stops.
- `aclose_and_drain()` does the same and returns, once, the settled outcomes no awaitable has
  claimed, as futures; rollouts the close itself cancelled are not among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from producer.api.model import Outcome
from schemas.errors import RolloutFailedError
from schemas.finish import FinishResult
from schemas.outcomes import Ended

log = logging.getLogger(__name__)

Pair = tuple[dict[str, Any], Any]
"""What an awaitable resolves to: the caller's row and the result (or a failure record)."""

# Outcomes the close itself produces: they are not "completed work" a drain returns.
CLOSED_KINDS = frozenset({Ended.CANCELLED, Ended.STOPPED})


class Transport(Protocol):
    """What the completions need of the dispatch (`producer.api.transport.Invocation`)."""

    on_outcome: Callable[[Outcome], None]
    finished: FinishResult | None

    def start(self) -> None: ...

    def stop_publishing(self) -> None: ...

    def close(self) -> None: ...

    def consumed(self, index: int) -> None: ...


@dataclass
class Settled:
    """A row's outcome turned into what its awaitable returns or raises."""

    kind: Ended
    value: Pair | None = None
    error: BaseException | None = None
    index: int | None = None
    """The row it settles (set by `Completions`)."""

    @property
    def cancelled(self) -> bool:
        return self.kind == Ended.CANCELLED

    def unwrap(self) -> Pair:
        if self.cancelled:
            raise asyncio.CancelledError()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


Convert = Callable[[Outcome], Settled]


class _Completion:
    """One handed-out awaitable; its work starts only when awaited."""

    def __init__(self, owner: Completions) -> None:
        self._owner = owner

    def __await__(self) -> Generator[Any, None, Pair]:
        return self._owner._claim().__await__()


class Completions:
    """The iterator `run_examples` returns: one awaitable per row, resolving in completion order."""

    def __init__(self, total: int, transport: Transport, convert: Convert, bounded: bool) -> None:
        self._total = total
        self._handed = 0
        self._transport = transport
        self._convert = convert
        self._bounded = bounded
        self._inbox: deque[Settled] = deque()
        self._ready: deque[Settled] = deque()
        self._waiters: deque[asyncio.Future[Settled]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._drained = False
        self._late: list[Settled] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._pump_scheduled = False
        transport.on_outcome = self._deliver

    def __iter__(self) -> Completions:
        return self

    def __next__(self) -> Awaitable[Pair]:
        if self._closed or self._handed >= self._total:
            raise StopIteration
        self._handed += 1
        if not self._bounded:
            self._transport.start()
        return _Completion(self)

    def __len__(self) -> int:
        return self._total

    @property
    def finished(self) -> FinishResult | None:
        """The recorded shard's finish result (state, counts, health) once the call ended or closed."""
        return self._transport.finished

    async def __aenter__(self) -> Completions:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # Delivery (listener thread -> caller's loop)

    def _deliver(self, outcome: Outcome) -> None:
        """Called from the listener thread for every settled row; never raises into it."""
        try:
            settled = self._convert(outcome)
        except Exception as exc:  # an outcome that cannot be turned into a result is its error
            log.exception("run_examples: the outcome of row %d cannot be read", outcome.index)
            error = RolloutFailedError(f"the outcome of row {outcome.index} cannot be read: "
                                       f"{type(exc).__name__}: {exc}", {})  # fmt: skip
            error.__cause__ = exc
            settled = Settled(Ended.ERROR, error=error)
        settled.index = outcome.index
        self._inbox.append(settled)
        loop = self._loop
        # One wake-up of the caller's loop per burst of outcomes, not one per outcome.
        if loop is not None and not self._pump_scheduled:
            self._pump_scheduled = True
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        while self._inbox:
            settled = self._inbox.popleft()
            if self._closed:
                if self._late is not None and settled.kind not in CLOSED_KINDS:
                    self._late.append(settled)
                continue
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(settled)
                    break
            else:
                self._ready.append(settled)

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("the awaitables of one run_examples call belong to one event loop")
        return loop

    async def _claim(self) -> Pair:
        loop = self._bind()
        if self._bounded and not self._closed:
            self._transport.start()  # bounded admission starts at the first await
        self._pump()
        if self._ready and not (self._closed and self._bounded):
            return self._taken(self._ready.popleft())
        if self._closed:
            raise asyncio.CancelledError()
        waiter: asyncio.Future[Settled] = loop.create_future()
        self._waiters.append(waiter)
        try:
            settled = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._ready.appendleft(waiter.result())  # claimed, then its task was cancelled
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            raise
        return self._taken(settled)

    def _taken(self, settled: Settled) -> Pair:
        """The awaitable hands `settled` out: the transport notes it consumed."""
        if settled.index is not None and not settled.cancelled:
            self._transport.consumed(settled.index)
        return settled.unwrap()

    # Closing

    def _begin_close(self) -> asyncio.Future[None]:
        if self._closing is None:
            self._closed = True
            self._transport.stop_publishing()
            for waiter in self._waiters:
                waiter.cancel()
            self._waiters.clear()
            self._closing = asyncio.ensure_future(asyncio.to_thread(self._transport.close))
        return self._closing

    async def aclose(self) -> None:
        """Cancel unfinished rollouts and wait until none of them runs any more.

        Queued rollouts never start; running `/run` calls are cancelled by their workers, which
        closes their connections. Agent-side cleanup is not awaited. Safe to call again, and
        before first use (nothing starts).
        """
        self._bind()
        await asyncio.shield(self._begin_close())

    async def aclose_and_drain(self) -> list[asyncio.Future[Pair]]:
        """Stop, cancel the rest, and return the settled outcomes no awaitable claimed, once.

        Each future yields `(row, result)` or raises the rollout's error. Outcomes that settle
        while the close waits for running rollouts (they finished before their worker saw the
        cancel) are included; rollouts the close cancelled are not. A second call, or a call
        after `aclose()`, returns `[]`.
        """
        loop = self._bind()
        if self._drained or self._closed:
            self._drained = True
            await asyncio.shield(self._begin_close())
            return []
        self._drained = True
        self._pump()
        snapshot = list(self._ready)
        self._ready.clear()
        self._late = []
        await asyncio.shield(self._begin_close())
        self._pump()
        late, self._late = self._late, None
        for s in snapshot + late:
            if s.index is not None and not s.cancelled:
                self._transport.consumed(s.index)
        return [_as_future(loop, s) for s in snapshot + late]


def _as_future(loop: asyncio.AbstractEventLoop, settled: Settled) -> asyncio.Future[Pair]:
    future: asyncio.Future[Pair] = loop.create_future()
    if settled.cancelled:
        future.cancel()
    elif settled.error is not None:
        future.set_exception(settled.error)
        future.exception()  # retrieved: an abandoned future logs nothing
    else:
        assert settled.value is not None
        future.set_result(settled.value)
    return future
