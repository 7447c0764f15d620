"""OpenTelemetry for every process of a run: whether it is on, its providers, the W3C trace context.

Off by default. A process turns it on with `ROLLOUTS_OTEL_ENABLED=1` (the producer also with the
run setting `telemetry_enabled`); `OTEL_SDK_DISABLED=true` keeps it off. The standard `OTEL_*`
variables configure the rest: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`,
`..._METRICS_ENDPOINT`, `..._HEADERS`; OTLP over HTTP/protobuf), `OTEL_SERVICE_NAME` (default
`rollouts`; each process is `<name>/<role>`, NeMo Gym's `<service_name>/<server name>`),
`OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`.

The SDK (the `telemetry` extra) is imported only by `setup`, once the process is on; without
the extra a process that asks for it logs one warning and stays off. Off, `tracer()` is None and
every caller takes its no-op path: one global read per call site, nothing allocated.

The trace context itself needs no SDK: `traceparent` is parsed and forwarded as a string
(`TraceParent`), so a worker without the extra still records the rollout's trace id and hands
its `traceparent` to the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENABLED_VAR = "ROLLOUTS_OTEL_ENABLED"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
ENQUEUED_AT = "rollouts_enqueued_ns"
"""The message header with when a rollout's task was published (Unix nanoseconds): the start of
its queue-wait span."""
ROLLOUT_ID = "nemo.gym.rollout.id"
"""NeMo Gym's span attribute for the rollout id."""
RUN_ID = "run_id"
"""NeMo Gym's resource attribute (its collector's) for the run."""
SERVICE_NAME = "rollouts"
INSTRUMENTATION = "rollouts"

_TRUE = frozenset({"1", "true", "yes", "on"})
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True)
class TraceParent:
    """A W3C `traceparent` value, parsed without the SDK."""

    trace_id: str
    """32 lowercase hex digits."""
    span_id: str
    flags: str

    @classmethod
    def parse(cls, value: Any) -> TraceParent | None:
        """The value of a `traceparent` header; None when it is absent or malformed (W3C: an
        all-zero trace or span id is invalid, and so is version ff)."""
        if not isinstance(value, str):
            return None
        m = _TRACEPARENT.match(value.strip().lower())
        if m is None or m.group(1) == "ff":
            return None
        trace_id, span_id = m.group(2), m.group(3)
        if trace_id == "0" * 32 or span_id == "0" * 16:
            return None
        return cls(trace_id, span_id, m.group(4))

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


_rollout: ContextVar[TraceParent | None] = ContextVar("rollouts_trace", default=None)
"""The trace context the current rollout (or finish step) was delivered with."""


def current_parent() -> TraceParent | None:
    """The trace context this task was delivered with, if its message carried one."""
    return _rollout.get()


def current_trace_id() -> str | None:
    found = _rollout.get()
    return found.trace_id if found is not None else None


@contextlib.contextmanager
def delivered(parent: TraceParent) -> Iterator[None]:
    """Within this block, `parent` is the delivered trace context (this thread or task), and
    the remote parent of the spans started in it, once the SDK is set up."""
    token = _rollout.set(parent)
    attached = None
    if _state.tracer is not None:
        from opentelemetry import context

        attached = context.attach(parent_context(parent))
    try:
        yield
    finally:
        if attached is not None:
            from opentelemetry import context

            context.detach(attached)
        _rollout.reset(token)


def truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


class _State:
    """This process's telemetry: asked for or not, and its providers once set up."""

    def __init__(self) -> None:
        self.asked = truthy(os.environ.get(ENABLED_VAR))
        self.tracer: Any = None
        self.meter: Any = None
        self.providers: list[Any] = []
        self.role: str | None = None
        self.pid = os.getpid()
        self.lock = threading.Lock()


_state = _State()


def requested() -> bool:
    """Whether this process was asked for telemetry (its environment or `request`)."""
    return _state.asked and not truthy(os.environ.get("OTEL_SDK_DISABLED"))


def request() -> None:
    """Ask for telemetry in this process (the producer's run setting); `setup` still needs calling."""
    _state.asked = True


def tracer() -> Any:
    """The process's tracer once set up, else None (the no-op path)."""
    return _state.tracer


def meter() -> Any:
    """The process's meter once set up, else None."""
    return _state.meter


def setup(
    role: str, attributes: Mapping[str, Any] | None = None, span_exporter: Any = None
) -> bool:
    """Set up the SDK for this process as `role` (producer, worker, capture_proxy) if asked.

    Idempotent; returns whether tracing is on. `attributes` join the resource (e.g. `run_id`).
    `span_exporter` replaces the `OTEL_*` exporters: spans go to it as each ends, and no
    metrics are exported (unit tests, with the SDK's in-memory exporter).
    """
    if _state.tracer is not None:
        return True
    if not requested():
        return False
    with _state.lock:
        if _state.tracer is not None:
            return True
        try:
            _install(role, dict(attributes or {}), span_exporter)
        except ImportError as exc:
            log.warning("telemetry was asked for but the OpenTelemetry SDK is not installed "
                        "(pip install 'rollouts[telemetry]'): %s; it stays off", exc)  # fmt: skip
            _state.asked = False
            return False
    return True


def _install(role: str, attributes: dict[str, Any], span_exporter: Any) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    base = os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME
    resource = Resource.create(
        {
            "service.name": f"{base}/{role}",
            "service.namespace": base,
            "rollouts.role": role,
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
            **attributes,
        }
    )
    traces = (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        traces = "none"
    elif traces == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif traces != "none":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _state.providers.append(provider)
    _state.tracer = provider.get_tracer(INSTRUMENTATION)
    _state.role = role
    metrics = (os.environ.get("OTEL_METRICS_EXPORTER") or "otlp").strip().lower()
    if metrics != "none" and span_exporter is None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        if metrics == "console":
            exporter: Any = ConsoleMetricExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter()
        meters = MeterProvider(
            resource=resource, metric_readers=[PeriodicExportingMetricReader(exporter)]
        )
        _state.providers.append(meters)
        _state.meter = meters.get_meter(INSTRUMENTATION)


def flush(timeout_s: float = 10.0) -> None:
    """Export what is buffered (the producer at the end of a run; a worker before it stops)."""
    for provider in _state.providers:
        with contextlib.suppress(Exception):
            provider.force_flush(int(timeout_s * 1000))


def parent_context(parent: TraceParent | None) -> Any:
    """An OpenTelemetry context whose remote parent is `parent` (needs the SDK set up)."""
    from opentelemetry import trace

    if parent is None:
        return None
    ctx = trace.SpanContext(
        int(parent.trace_id, 16),
        int(parent.span_id, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(parent.flags, 16)),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def traceparent_of(span: Any) -> str | None:
    """The `traceparent` naming `span` as the parent."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def link_to(span: Any) -> Any:
    """A span link to `span` (the job span of a rollout's trace)."""
    from opentelemetry import trace

    return trace.Link(span.get_span_context())


def inject(headers: dict[str, str]) -> None:
    """Add the `traceparent` of the current span, else of the delivered trace context, to
    `headers` (an outgoing HTTP request's)."""
    t = _state.tracer
    if t is not None:
        from opentelemetry import trace

        value = traceparent_of(trace.get_current_span())
        if value is not None:
            headers[TRACEPARENT] = value
            return
    parent = _rollout.get()
    if parent is not None:
        headers[TRACEPARENT] = parent.header()


def now_ns() -> int:
    return time.time_ns()


class _Client:
    """An HTTP client span being recorded (`client_span`)."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers` with this span's `traceparent`."""
        if self.span is not None:
            value = traceparent_of(self.span)
            if value is not None:
                for name in [k for k in headers if k.lower() == TRACEPARENT]:
                    del headers[name]  # a forwarded caller's, in whatever case
                headers[TRACEPARENT] = value
        else:
            inject(headers)
        return headers

    def status(self, code: int) -> None:
        if self.span is None:
            return
        self.span.set_attribute("http.response.status_code", code)
        if code >= 400:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", str(code))
            self.span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))

    def set(self, key: str, value: Any) -> None:
        if self.span is not None and value is not None:
            self.span.set_attribute(key, value)

    def failed(self, exc: BaseException) -> None:
        """The request failed with `exc`, handled by the caller."""
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", type(exc).__name__)
            self.span.set_status(Status(StatusCode.ERROR, str(exc)[:200] or type(exc).__name__))


_NO_CLIENT = _Client(None)


@contextlib.contextmanager
def client_span(
    method: str, url: str, attributes: Mapping[str, Any] | None = None
) -> Iterator[_Client]:
    """One outgoing HTTP request: a CLIENT span `HTTP <METHOD>` (NeMo Gym's name; the HTTP
    semantic conventions' attributes) whose `traceparent` the request carries (`.headers`).

    Recorded only within a delivered trace context (`delivered`): a task of an untraced run
    records nothing. Off, the request still carries the delivered `traceparent`, if any. An
    exception that leaves the block is recorded with its type as `error.type`, and re-raised.
    """
    t = _state.tracer
    if t is None or _rollout.get() is None:
        yield _NO_CLIENT
        return
    from urllib.parse import urlsplit

    from opentelemetry.trace import SpanKind, Status, StatusCode

    parts = urlsplit(url)
    attrs: dict[str, Any] = {
        "http.request.method": method,
        "url.full": parts._replace(query="", fragment="").geturl(),
        "server.address": parts.hostname or "",
    }
    if parts.port is not None:
        attrs["server.port"] = parts.port
    attrs.update(attributes or {})
    with t.start_as_current_span(
        f"HTTP {method}", kind=SpanKind.CLIENT, attributes=attrs, record_exception=False,
        set_status_on_exception=False,
    ) as span:  # fmt: skip
        try:
            yield _Client(span)
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200] or type(exc).__name__))
            raise


@contextlib.contextmanager
def served(
    name: str, traceparent: str | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[_Client]:
    """An incoming HTTP request's SERVER span, under the `traceparent` it carried; within it
    that is the delivered trace context. A request without one, or a process without
    telemetry, records nothing."""
    t = _state.tracer
    parent = TraceParent.parse(traceparent) if t is not None else None
    if parent is None:
        yield _NO_CLIENT
        return
    from opentelemetry.trace import SpanKind

    with (
        delivered(parent),
        t.start_as_current_span(name, kind=SpanKind.SERVER, attributes=attributes) as span,
    ):
        yield _Client(span)
