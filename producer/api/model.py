"""The values the parts of a `run_examples` call hand each other: a row's `Outcome` as the
listener received it, and the call's `Target` (where its rollouts go)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery

from schemas.config import ServersConfig
from schemas.messages import RunRef
from schemas.outcomes import Ended
from schemas.settings import CollectionSettings


@dataclass
class Outcome:
    """One row's final outcome, as the listener received it."""

    index: int
    kind: Ended
    result: dict[str, Any] | None = None
    error: str | None = None
    perf: dict[str, float] | None = None
    """`rollout_latency_ms` and `queue_wait_ms`, for rollouts that ran."""
    cause: BaseException | None = None
    """What made the call give up on the row (`error`), when it was an exception."""
    timed_out: bool = False
    """No outcome came within `result_timeout_s`: the awaitable raises `TimeoutError`."""


@dataclass
class Target:
    """Where the call's rollouts go and how they are admitted."""

    app: Celery
    redis_url: str
    run: RunRef
    config: ServersConfig
    settings: CollectionSettings
    deadline: float | None
    record: bool
    record_omitted: bool = False
    """Write `_ng_omitted` rows for the rows a close left without an outcome."""
