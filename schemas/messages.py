"""Payloads of the Celery tasks: validated by each task before it calls plain code."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import Field, ValidationError

from schemas.base import FrozenModel, StrictModel
from schemas.feed import FeedMember
from schemas.settings import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_RATE_LIMIT_BUDGET_S,
    DEFAULT_RATE_LIMIT_MAX_WAIT_S,
    DEFAULT_READ_IDLE_TIMEOUT_S,
    DEFAULT_ROLLOUT_TIMEOUT_S,
)

COLLECT_TASK = "rollouts.collect"
"""Task name of one rollout."""
FINISH_TASK = "rollouts.finish"
"""Task name of the chord callback that finishes a shard."""
OMIT_TASK = "rollouts.omit"
"""Task name of a recorded Python API call's omissions (`record_omitted_rollouts`)."""
QUEUE = "rollouts"
"""The queue rollout tasks go to."""


class RunRef(FrozenModel):
    """Which shard of which run a task belongs to, and the dispatch generation that sent it."""

    run_id: str
    """The run's id (stable across resumes)."""
    output_dir: str
    """The run directory, an fsspec URL or a local path."""
    shard: str = "0"
    """The shard label."""
    token: str
    """The opener token of the dispatch generation; a stale token is fenced out."""
    generation: int = 0
    """That generation's index in the manifest: the first half of each record's execution."""


class CallPolicy(FrozenModel):
    """How a worker calls `/run` for one rollout."""

    timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S
    """Time limit of the rollout."""
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    """Largest reply body, in decompressed bytes; reading stops as soon as it is passed."""
    read_idle_timeout_s: float = DEFAULT_READ_IDLE_TIMEOUT_S
    """Longest silence within a reply body before the attempt fails as a timeout."""
    heartbeat_s: float | None = None
    """Write CRLF on the connection this often until the reply begins (None: never)."""
    retry_requests: bool = True
    """Replay a request that failed after it was sent."""
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempt limit, also for redeliveries after a worker died."""
    route_failures_to_sidecar: bool = False
    """Whether a failure leaves the run going."""
    connect_retries: int = 6
    """Retries of a connection that was never established (always safe)."""
    backoff_base_s: float = 0.5
    """First backoff delay; it doubles per retry, with full jitter, capped at 30 s."""
    rate_limit_budget_s: float = DEFAULT_RATE_LIMIT_BUDGET_S
    """Longest the rollout waits out 429/503 replies in all (waits consume no attempt)."""
    rate_limit_max_wait_s: float = DEFAULT_RATE_LIMIT_MAX_WAIT_S
    """Cap on one wait: a larger `Retry-After` is cut to this."""


class Admission(FrozenModel):
    """When a rollout may start: the cluster-wide caps and the dispatch budget (docs/explanation/contract.md#failures)."""

    max_resident_tasks: int | None = None
    """At most this many rollouts of the run running at once, across the cluster."""
    agent_max_concurrency: int | None = None
    """At most this many `/run` calls to this rollout's agent at once, across all runs."""
    dispatch_deadline: float | None = None
    """No start after this instant (Redis server clock, seconds since the epoch)."""
    dispatch_budget_s: float | None = None
    """The budget the deadline came from, for messages."""
    drain_margin_s: float | None = None
    """Stop starting this long before the deadline; None: the p75 of observed durations."""


class CaptureRef(StrictModel):
    """Where a rollout's model calls are captured, when observability is on."""

    dir: str
    """The `model_call_capture_dir` URL."""
    delete_after_merge: bool = False
    """Delete the rollout's capture files once merged."""
    include_payloads: bool = True
    """Keep the calls' request and response bodies in the merged `ng_trajectory`."""


class HealthRef(FrozenModel):
    """That the worker landing a rollout judges it and counts its verdict (live health)."""

    ignored: list[str] = Field(default_factory=list)
    """The check ids the run's health check skips (`health_check_ignored_checks`)."""


class CollectRequest(StrictModel):
    """One rollout: the planned row and where its agent listens."""

    run: RunRef
    """The run and shard the result lands in."""
    agent_url: str
    """Base URL of the agent (or, for a materialized task row, of its environment server);
    `/run` is appended."""
    policy: CallPolicy = CallPolicy()
    """Timeouts and retries."""
    row: dict[str, Any]
    """The planned row, sent as the `/run` body."""
    admission: Admission = Admission()
    """Caps and budget that decide when the rollout may start."""
    capture: CaptureRef | None = None
    """The run's capture dir; None when observability is off."""
    health: HealthRef | None = None
    """Count the landed result's verdict live; None when the run's health check is off."""
    feed: FeedMember | None = None
    """The feed and group the rollout enters as it lands; None when its run has no feed."""


R = TypeVar("R", bound=CollectRequest)


class SharedParts:
    """Validates rollout messages, sharing the parts that every rollout of a generation carries
    the same: its run, call policy, admission and health.

    A worker holds the request of every rollout it runs (thousands at once), and Celery holds
    each delivery's decoded payload until it is acknowledged (`celery inspect active` shows
    it). Each held its own copy of those four parts, most of its size. Each part is now
    validated once per distinct JSON, and the requests share that frozen model; the payloads
    share the first decoded copy (equal to their own). A bench rollout's request took 4.5 KB
    and 14 µs to validate, and takes 1.3 KB and 7 µs; its payload 3.0 KB, and 1.3 KB
    (`docs/explanation/performance.md`).

    A request validates exactly as `model_validate` does: a part that fails on its own is not
    shared, and a payload that fails does so with the errors (locations, inputs) of a plain
    validation, untouched.
    """

    PARTS: ClassVar[dict[str, type[FrozenModel]]] = {
        "run": RunRef,
        "policy": CallPolicy,
        "admission": Admission,
        "health": HealthRef,
    }
    """The fields shared, and their models."""

    def __init__(self, most: int = 256) -> None:
        self._most = most
        self._parts: dict[tuple[str, bytes], tuple[FrozenModel, dict[str, Any]]] = {}

    def validate(self, model: type[R], payload: Any) -> R:
        """`model.model_validate(payload)`, with the shared parts taken from what was validated
        before; once it validated, the payload's own copies of them are swapped for the shared
        ones."""
        if not isinstance(payload, dict):
            return model.model_validate(payload)
        shared: dict[str, tuple[FrozenModel, dict[str, Any]]] = {}
        for name, part_model in self.PARTS.items():
            value = payload.get(name)
            if not isinstance(value, dict):
                continue
            try:
                key = (name, orjson.dumps(value))
            except orjson.JSONEncodeError:
                continue  # not JSON (built in process): validated on its own below
            part = self._parts.get(key)
            if part is None:
                try:
                    part = (part_model.model_validate(value), value)
                except ValidationError:
                    continue  # the whole payload fails below, located as usual
                if len(self._parts) >= self._most:
                    self._parts.clear()  # a worker sees a handful at a time: no order kept
                self._parts[key] = part
            shared[name] = part
        if not shared:
            return model.model_validate(payload)
        try:
            request = model.model_validate(
                {**payload, **{name: part for name, (part, _) in shared.items()}}
            )
        except ValidationError:
            return model.model_validate(payload)  # raises, with the payload as it came
        for name, (_, value) in shared.items():
            payload[name] = value
        return request


class FinishRequest(StrictModel):
    """The chord callback's payload: the shard to finish."""

    run: RunRef
    """The run and shard to finish."""


class OmitRequest(StrictModel):
    """Rows of a recorded shard to write as intentional omissions (`_ng_omitted` sidecar rows)."""

    run: RunRef
    """The recorded shard, and the generation the omissions belong to."""
    rows: list[dict[str, Any]]
    """The planned rows left out (their identity is what is written)."""
    why: str
    """The omission's message."""
