"""What the rollout engine works with: its collaborators, passed in as one per-process context.

The engine (`workers/rollout/engine.py`) reaches Redis, storage and the agent only through these:
an admission gate, a lander, an agent caller and the rollout leases. A worker process builds the real ones
once (`process_context`); unit tests build a context of in-memory fakes (`workers/rollout/fakes.py`)
and an agent caller whose client is an `httpx.AsyncClient` over `httpx.MockTransport`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra.environment import from_env
from infra.http import EventLoopThread, PostClient, process_io
from infra.process import PerProcess
from schemas.messages import CallPolicy, CollectRequest, RunRef
from workers.admission import Ticket, gate
from workers.agent_call import CallOutcome, call_run
from workers.landing import LAND_WAIT_S, LandReport, lander
from workers.leases import Lease, LeaseTicket, RolloutLeases, Stage
from workers.redispatch import publisher, unacked_sweep
from workers.shard.trust import ManifestCheck

STOP_POLL_S = 0.5


class AdmissionGate(Protocol):
    """Whether a rollout may start, the slots it holds, and the run's stop flags (`workers/admission.py`)."""

    def admit(self, req: CollectRequest, sid: str, readmit: Ticket | None = None) -> Ticket: ...

    def free_slot(self, ticket: Ticket, token: str, ok: bool = False) -> None: ...

    def back_off(
        self, ticket: Ticket, status: int, wait_s: float | None, call_s: float
    ) -> None: ...

    def release(
        self, ticket: Ticket, token: str, field: str = "done", duration_s: float | None = None
    ) -> None: ...

    def stop_reason(self, sid: str) -> str | None: ...

    def margin_s(self, sid: str, req: CollectRequest) -> float | None: ...

    def fail_run(self, sid: str, message: str) -> None: ...


class RecordLander(Protocol):
    """Lands a rollout's records in its shard exactly once (`workers/landing.py`)."""

    def submit(
        self,
        run: RunRef,
        result: dict[str, Any] | None,
        failures: list[dict[str, Any]],
        lease: Lease | None = None,
    ) -> concurrent.futures.Future[LandReport]:
        """Queue the records (of the attempt holding `lease`); the future settles with the report,
        or the error that failed them (`ShardFencedError`: a newer writer or attempt)."""
        ...


class LeaseKeeper(Protocol):
    """Rollout leases: who runs each rollout, and the takeover of silent ones (`workers/leases.py`)."""

    def take(self, sid: str, key: str, token: str, message: dict[str, Any]) -> LeaseTicket: ...

    def stage(self, lease: Lease, stage: Stage) -> None: ...

    def current(self, lease: Lease) -> bool: ...

    def settle(self, lease: Lease, token: str) -> bool: ...

    def forget(self, lease: Lease) -> None: ...


class RunCheck(Protocol):
    """Why a task's run fields must not be trusted, or None (`ManifestCheck`)."""

    def refusal(self, run: RunRef, agent_url: str) -> str | None: ...


class LoopCaller:
    """`call_run` on an event loop thread; the calling thread polls the stop flags meanwhile.

    A stop (the run failed or was cancelled; a drain lets calls finish) cancels the call's
    coroutine, which closes its connection: the agent sees the client go away.
    """

    def __init__(
        self, loop: EventLoopThread, client: Callable[[], PostClient], poll_s: float = STOP_POLL_S
    ) -> None:
        self._loop = loop
        self._client = client
        self._poll_s = poll_s

    def call(
        self,
        agent_url: str,
        row: dict[str, Any],
        policy: CallPolicy,
        stopped: Callable[[], str | None],
    ) -> tuple[CallOutcome | None, str | None]:
        future = self._loop.submit(call_run(self._client(), agent_url, row, policy))
        while True:
            try:
                return future.result(timeout=self._poll_s), None
            except concurrent.futures.TimeoutError:
                reason = stopped()
                if reason is not None and reason != "drain":
                    future.cancel()
                    return None, reason


@dataclass(frozen=True)
class RolloutContext:
    """A worker process's collaborators of the rollout engine."""

    gate: AdmissionGate
    """Admission, slots, stop flags."""
    lander: RecordLander
    """The group-commit writer of the shards."""
    agent: LoopCaller
    """The `/run` caller (unit tests give it an `httpx.AsyncClient` over `httpx.MockTransport`)."""
    monotonic: Callable[[], float] = field(default=time.monotonic)
    """The clock durations are measured with."""
    sleep: Callable[[float], None] = field(default=time.sleep)
    """How the engine waits between landing retries and out rate limits."""
    land_wait_s: float = LAND_WAIT_S
    """How long one landing attempt may take before the rollout ends in error."""
    leases: LeaseKeeper | None = None
    """The rollout leases; None: deliveries take none."""
    runs: RunCheck | None = None
    """Vouches for a recorded task's run fields before anyone is called (the shard's manifest,
    `workers/shard/trust.py`); None trusts every task (unit tests of the other steps)."""


def _real_context(redis_url: str) -> RolloutContext:
    io = process_io()
    return RolloutContext(
        gate=gate(redis_url),
        lander=lander(redis_url),
        agent=LoopCaller(io.loop, lambda: io.http),
        leases=_leases.get(redis_url),
        runs=ManifestCheck(),
    )


def _real_leases(redis_url: str) -> RolloutLeases:
    from workers.app import app  # the worker's app publishes the rollouts it takes over

    publish = publisher(app)
    found = unacked_sweep(app, redis_url, publish, from_env().lease_ttl_s)
    return RolloutLeases(redis_url, publish=publish, sweep=found.sweep if found else None)


_leases: PerProcess[str, RolloutLeases] = PerProcess(_real_leases)


_contexts: PerProcess[str, RolloutContext] = PerProcess(_real_context)


def process_context(redis_url: str) -> RolloutContext:
    """This process's context for the Redis at `redis_url`, made on first use (after any fork)."""
    return _contexts.get(redis_url)
