"""A run's traces: the job span on the producer, then one trace per rollout, linked to it.

The producer opens `gym.job` (NeMo Gym's name) per dispatch generation (`job`) and, for each
rollout task it publishes, a PRODUCER span `rollouts.enqueue` that is the root of that rollout's
own trace, linked to the job span (`enqueued`): a million-rollout run is a million small traces,
not one. The rollout's `traceparent` and its publish time travel in the Celery message headers
(`CollectTaskMessage.headers`), which a redelivery keeps and a takeover publishes again, so every
attempt of a rollout lands in one trace. The finish callback carries the job span's.

On a worker each delivery of a traced rollout (`delivery`) records `rollouts.queue_wait`
(publish to delivery) and `rollouts.collect` (CONSUMER), under which come
`rollouts.admission_wait` (`workers/rollout/admission.py`), one CLIENT span `HTTP POST` per `/run`
attempt with its `traceparent` sent to the agent (`workers/rollout/agent_call.py`),
`rollouts.rate_limit_wait`, `rollouts.capture_merge` and `rollouts.land` with its
`rollouts.land.lock_wait` and `rollouts.land.write` (`workers/rollout/landing.py`). The finish step
(`finishing`) records `rollouts.finish`, an `HTTP POST` per `/aggregate_metrics` call and
`rollouts.health_check`. How a rollout ended is the collect span's `rollouts.ended`, its
failure class `rollouts.failure_class`, and its status.

A task whose message carries no `traceparent` (a run without telemetry) records nothing and
stamps nothing. One that carries one stamps the trace id on every record it lands
(`_ng_trace_id`) and forwards `traceparent` to the agent even where this worker has no SDK.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import redis
from celery.exceptions import Ignore

from infra import telemetry
from infra.environment import redis_url
from infra.redis_client import client
from infra.telemetry import ENQUEUED_AT, ROLLOUT_ID, RUN_ID, TRACEPARENT, TraceParent
from schemas import fields as F
from schemas.messages import QUEUE
from schemas.outcomes import FAILURE_ENDS, Ended, RolloutOutcome

_ERROR_ENDS = frozenset({*FAILURE_ENDS, Ended.ERROR})

SpanAttributes = dict[str, str | int | bool]
"""A span's attributes, as OpenTelemetry takes them."""


def _status(span: Any, ok: bool, message: str | None = None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.OK) if ok else Status(StatusCode.ERROR, message))


def rollout_attributes(row: Mapping[str, Any], run: Mapping[str, Any]) -> SpanAttributes:
    """What names a rollout on its spans: NeMo Gym's rollout id, its indices, its run."""
    attrs: SpanAttributes = {
        RUN_ID: str(run.get("run_id", "")),
        "rollouts.shard": str(run.get("shard", "")),
        "rollouts.task_index": int(row.get(F.TASK_INDEX, -1)),
        "rollouts.rollout_index": int(row.get(F.ROLLOUT_INDEX, -1)),
    }
    rid = F.rollout_id(dict(row))
    if rid is not None:
        attrs[ROLLOUT_ID] = rid
    agent = F.agent_name(dict(row))
    if agent:
        attrs["rollouts.agent"] = agent
    return attrs


# The producer: the job span and each rollout's root.


class Job:
    """A dispatch generation's `gym.job` span, or the no-op one (`span` None)."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self._link = telemetry.link_to(span) if span is not None else None

    def callback_headers(self) -> dict[str, str] | None:
        """The finish callback's message headers: the job span as its parent."""
        if self.span is None:
            return None
        value = telemetry.traceparent_of(self.span)
        return {TRACEPARENT: value} if value is not None else None

    def enqueued(
        self, row: Mapping[str, Any], run: Mapping[str, Any], task_id: str
    ) -> dict[str, str | int] | None:
        """The trace headers of one rollout task: a new trace, its root linked to the job span."""
        if self.span is None:
            return None
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind

        t = telemetry.tracer()
        attrs = rollout_attributes(row, run)
        attrs["messaging.system"] = "celery"
        attrs["messaging.operation.type"] = "publish"
        attrs["messaging.message.id"] = task_id
        now = telemetry.now_ns()
        span = t.start_span(
            "rollouts.enqueue", context=Context(), kind=SpanKind.PRODUCER, links=[self._link],
            attributes=attrs, start_time=now,
        )  # fmt: skip
        span.end(end_time=now)
        value = telemetry.traceparent_of(span)
        return {TRACEPARENT: value, ENQUEUED_AT: now} if value is not None else None

    def finished(self, state: str | None, error: str | None) -> None:
        if self.span is None:
            return
        if state is not None:
            self.span.set_attribute("rollouts.state", state)
        _status(self.span, state not in ("failed",), error)

    def within(self) -> contextlib.AbstractContextManager[None]:
        """Steps run here (the Python API's finish) are in the job's trace."""
        value = self.callback_headers()
        parent = TraceParent.parse(value[TRACEPARENT]) if value else None
        return telemetry.delivered(parent) if parent is not None else _NULL

    def end(self) -> None:
        """End the job span and export what is buffered (a job not opened as a block)."""
        if self.span is not None:
            self.span.end()
            telemetry.flush()


NO_JOB = Job(None)


def start_job(run_id: str, shard: str, token: str, planned: int) -> Job:
    """A job span for the Python API's call (`Job.end` ends it); NO_JOB when off."""
    if not telemetry.setup("producer", {RUN_ID: run_id}):
        return NO_JOB
    return Job(telemetry.tracer().start_span("gym.job", attributes=_job_attributes(
        run_id, shard, token, planned)))  # fmt: skip


def _job_attributes(run_id: str, shard: str, token: str, planned: int) -> SpanAttributes:
    return {RUN_ID: run_id, "rollouts.shard": shard, "rollouts.generation": token,
            "rollouts.planned": planned}  # fmt: skip


@contextlib.contextmanager
def job(run_id: str, shard: str, token: str, planned: int) -> Iterator[Job]:
    """One dispatch generation's job span, exported when the block ends; NO_JOB when off."""
    if not telemetry.setup("producer", {RUN_ID: run_id}):
        yield NO_JOB
        return
    attrs = _job_attributes(run_id, shard, token, planned)
    try:
        with telemetry.tracer().start_as_current_span("gym.job", attributes=attrs) as span:
            yield Job(span)
    finally:
        telemetry.flush()


# The worker: a delivery of a rollout, and the finish step.


class Delivered:
    """A rollout delivery's collect span (or none): records how the rollout ended (`ended`,
    or the module's `ended` where the task does not see the outcome)."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def ended(self, outcome: RolloutOutcome) -> None:
        span = self.span
        if span is None:
            return
        span.set_attribute("rollouts.ended", outcome.ended.value)
        record = outcome.record or {}
        failure = record.get(F.FAILURE_CLASS)
        if failure is not None:
            span.set_attribute("rollouts.failure_class", str(failure))
        if outcome.requests:
            span.set_attribute("rollouts.requests", outcome.requests)
        bad = outcome.ended in _ERROR_ENDS
        _status(span, not bad, f"{outcome.ended.value}: {failure or outcome.detail or ''}")
        _count_ended(outcome.ended.value, failure)
        if outcome.health is not None:
            span.set_attribute("rollouts.health.verdict", str(outcome.health.get("verdict")))
            _count_health(outcome.health)


_NO_DELIVERY = Delivered(None)
_current: ContextVar[Delivered] = ContextVar("rollouts_delivery", default=_NO_DELIVERY)


def ended(outcome: RolloutOutcome) -> None:
    """Record how the current delivery's rollout ended (the Python API's reply adapter)."""
    _current.get().ended(outcome)


def _delivery_attributes(request: Any, payload: Mapping[str, Any]) -> SpanAttributes:
    row, run = payload.get("row") or {}, payload.get("run") or {}
    attrs = rollout_attributes(row, run)
    attrs["messaging.system"] = "celery"
    attrs["messaging.operation.type"] = "process"
    if getattr(request, "id", None):
        attrs["messaging.message.id"] = str(request.id)
    info = getattr(request, "delivery_info", None) or {}
    attrs["rollouts.redelivered"] = bool(info.get("redelivered"))
    attrs["rollouts.attempt_index"] = int(row.get(F.ATTEMPT_INDEX) or 0)
    return attrs


@contextlib.contextmanager
def _consumed(name: str, request: Any, attrs: SpanAttributes, queue_wait: bool) -> Iterator[Any]:
    """Within the delivered context of `request`'s `traceparent`: its spans, when set up."""
    parent = TraceParent.parse(getattr(request, TRACEPARENT, None))
    if parent is None:
        yield None
        return
    if not telemetry.setup("worker"):
        with telemetry.delivered(parent):
            yield None
        return
    with telemetry.delivered(parent):
        from opentelemetry.trace import SpanKind

        t, ctx, now = telemetry.tracer(), telemetry.parent_context(parent), telemetry.now_ns()
        enqueued = getattr(request, ENQUEUED_AT, None)
        if queue_wait and isinstance(enqueued, int) and 0 < enqueued <= now:
            waited = t.start_span("rollouts.queue_wait", context=ctx, attributes=attrs,
                                  start_time=enqueued)  # fmt: skip
            waited.end(end_time=now)
        with t.start_as_current_span(
            name, context=ctx, kind=SpanKind.CONSUMER, attributes=attrs, start_time=now,
            record_exception=False, set_status_on_exception=False,
        ) as span:  # fmt: skip
            try:
                yield span
            except Ignore:  # a copy of a delivery, acknowledged: its outcome is on the span
                raise
            except BaseException as exc:
                span.record_exception(exc)
                _status(span, False, f"{type(exc).__name__}: {exc}")
                raise


class _Null(contextlib.AbstractContextManager[Any]):
    """The no-op path's context manager: enters as `value`, made once."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __enter__(self) -> Any:
        return self.value

    def __exit__(self, *_: object) -> None:
        return None


_NULL_DELIVERY = _Null(_NO_DELIVERY)
_NULL = _Null(None)


def delivery(
    request: Any, payload: Mapping[str, Any]
) -> contextlib.AbstractContextManager[Delivered]:
    """One delivery of a rollout task (`request`: its Celery request, `payload`: its JSON)."""
    if getattr(request, TRACEPARENT, None) is None:  # the no-op path: an untraced run
        return _NULL_DELIVERY
    return _delivery(request, payload)


@contextlib.contextmanager
def _delivery(request: Any, payload: Mapping[str, Any]) -> Iterator[Delivered]:
    attrs = _delivery_attributes(request, payload)
    with _consumed("rollouts.collect", request, attrs, queue_wait=True) as span:
        if span is None:
            yield _NO_DELIVERY
        else:
            _in_flight(1)
            traced = Delivered(span)
            token = _current.set(traced)
            try:
                yield traced
            finally:
                _current.reset(token)
                _in_flight(-1)


def finishing(request: Any, payload: Mapping[str, Any]) -> contextlib.AbstractContextManager[None]:
    """The finish step of a generation, under its job span."""
    if getattr(request, TRACEPARENT, None) is None:
        return _NULL
    return _finishing(request, payload)


@contextlib.contextmanager
def _finishing(request: Any, payload: Mapping[str, Any]) -> Iterator[None]:
    run = payload.get("run") or {}
    attrs: SpanAttributes = {
        RUN_ID: str(run.get("run_id", "")),
        "rollouts.shard": str(run.get("shard", "")),
    }
    with _consumed("rollouts.finish", request, attrs, queue_wait=False):
        yield


class _Step:
    """A step's span (or none), for attributes known only at its end."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def set(self, key: str, value: Any) -> None:
        if self.span is not None and value is not None:
            self.span.set_attribute(key, value)

    def fail(self, message: str) -> None:
        if self.span is not None:
            _status(self.span, False, message)


_NO_STEP = _Step(None)
_NULL_STEP = _Null(_NO_STEP)


def step(name: str, **attributes: Any) -> contextlib.AbstractContextManager[_Step]:
    """An INTERNAL span of the current rollout or finish step (none outside a traced one)."""
    t = telemetry.tracer()
    if t is None or telemetry.current_parent() is None:
        return _NULL_STEP
    return _step(t, name, attributes)


@contextlib.contextmanager
def _step(t: Any, name: str, attributes: dict[str, Any]) -> Iterator[_Step]:
    with t.start_as_current_span(name, attributes=attributes) as span:
        yield _Step(span)


def rate_limit_wait(status: int, wait_s: float) -> contextlib.AbstractContextManager[_Step]:
    """The engine's wait out of a 429/503 (not holding a slot), before it is admitted again."""
    _count_rate_limit(status)
    return step("rollouts.rate_limit_wait", **{"http.response.status_code": status,
                                              "rollouts.wait_s": wait_s})  # fmt: skip


# Landing: the rollout's span is opened where its records are handed to the lander and ended
# by the lander's thread with the batch's lock wait and write.


def stamp(result: dict[str, Any] | None, failures: list[dict[str, Any]]) -> None:
    """Stamp the rollout's trace id on the records it lands (nothing for an untraced one)."""
    trace_id = telemetry.current_trace_id()
    if trace_id is None:
        return
    if result is not None:
        result[F.TRACE_ID] = trace_id
    for row in failures:
        row[F.TRACE_ID] = trace_id


def landing() -> Any:
    """Start the rollout's `rollouts.land` span; None outside a traced rollout."""
    t = telemetry.tracer()
    if t is None or telemetry.current_parent() is None:
        return None
    return t.start_span("rollouts.land")


def landed(span: Any, waited: int, locked: int, written: int, refused: str | None = None) -> None:
    """End a landing span (lander thread): lock wait from `waited` to `locked`, the write to
    `written` (Unix ns); `refused`: why nothing was written."""
    from opentelemetry import trace

    ctx = trace.set_span_in_context(span)
    t = telemetry.tracer()
    t.start_span("rollouts.land.lock_wait", context=ctx, start_time=waited).end(end_time=locked)
    if refused is None:
        t.start_span("rollouts.land.write", context=ctx, start_time=locked).end(end_time=written)
    else:
        span.set_attribute("rollouts.refused", refused)
    _status(span, refused is None, refused)
    span.end(end_time=written)


def land_failed(span: Any, exc: BaseException) -> None:
    span.record_exception(exc)
    _status(span, False, f"{type(exc).__name__}: {exc}")
    span.end()


# Metrics, through the same SDK (made on first use; nothing when off).


class _Instruments:
    def __init__(self, meter: Any) -> None:
        def counter(name: str, unit: str, description: str) -> Any:
            return meter.create_counter(name, unit=unit, description=description)

        self.ended = counter("rollouts.rollouts.ended", "{rollout}",
                             "Rollout deliveries by how they ended and failure class")  # fmt: skip
        self.in_flight = meter.create_up_down_counter(
            "rollouts.rollouts.in_flight", unit="{rollout}",
            description="Traced rollout deliveries running on this worker",
        )  # fmt: skip
        self.run_latency = meter.create_histogram(
            "rollouts.run.duration", unit="s", description="One /run attempt, request to reply"
        )
        self.rate_limited = counter("rollouts.rate_limit.waits", "{wait}",
                                    "Rate-limit waits (a 429/503 from the agent)")  # fmt: skip
        self.verdicts = counter("rollouts.health.verdicts", "{rollout}",
                                "Landed results by live health verdict")  # fmt: skip
        self.findings = counter("rollouts.health.findings", "{finding}",
                                "Live health findings of landed results, by check")  # fmt: skip
        self.queue_depth = meter.create_observable_gauge(
            "rollouts.queue.depth", callbacks=[_queue_depth], unit="{message}",
            description="Tasks waiting in the rollouts queue (a Redis broker's), at each export",
        )  # fmt: skip


def _queue_depth(_options: Any) -> list[Any]:
    """The rollouts queue's length, read from a Redis broker once per metrics export."""
    from celery import current_app  # in a worker, its own app
    from opentelemetry.metrics import Observation

    url = redis_url(current_app.conf.broker_url)
    if url is None:
        return []
    try:
        depth = int(client(url).llen(QUEUE))
    except redis.RedisError:
        return []
    return [Observation(depth, {"messaging.destination.name": QUEUE})]


_instruments: list[_Instruments] = []


def _made() -> _Instruments | None:
    if _instruments:
        return _instruments[0]
    m = telemetry.meter()
    if m is None:
        return None
    _instruments.append(_Instruments(m))
    return _instruments[0]


def _count_ended(ended: str, failure: Any) -> None:
    made = _made()
    if made is not None:
        attrs = {"rollouts.ended": ended}
        if failure is not None:
            attrs["rollouts.failure_class"] = str(failure)
        made.ended.add(1, attrs)


def _count_health(health: Mapping[str, Any]) -> None:
    """A landed result's live verdict and findings (`RolloutVerdict.as_json`), into the counters."""
    made = _made()
    if made is None:
        return
    made.verdicts.add(1, {"rollouts.health.verdict": str(health.get("verdict"))})
    for check, n in (health.get("findings") or {}).items():
        made.findings.add(n, {"rollouts.health.check": str(check)})


def _in_flight(delta: int) -> None:
    made = _made()
    if made is not None:
        made.in_flight.add(delta)


def _count_rate_limit(status: int) -> None:
    made = _made() if telemetry.current_parent() is not None else None
    if made is not None:
        made.rate_limited.add(1, {"http.response.status_code": status})


def run_latency(seconds: float, status: int | None) -> None:
    """One `/run` attempt's latency, into the histogram."""
    made = _made() if telemetry.current_parent() is not None else None
    if made is not None:
        attrs = {"http.response.status_code": status} if status is not None else {}
        made.run_latency.record(seconds, attrs)
