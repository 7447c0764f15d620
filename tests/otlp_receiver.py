"""A real OTLP/HTTP receiver for tests: it decodes what exporters POST with `opentelemetry-proto`.

It listens on loopback (`/v1/traces`, `/v1/metrics`), answers each export with an empty
protobuf response, and keeps every span flattened into a `Span` (ids as lowercase hex).
`in_memory_sdk` sets up this test process's own telemetry with the SDK's in-memory exporter.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infra import telemetry
from tests.helpers import QuietHandler, serve_in_thread


def in_memory_sdk(monkeypatch: Any) -> InMemorySpanExporter:
    """This process traced (until the test ends), its spans kept in memory."""
    monkeypatch.setattr(telemetry, "_state", telemetry._State())
    telemetry.request()
    exporter = InMemorySpanExporter()
    assert telemetry.setup("worker", span_exporter=exporter)
    return exporter


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        assert isinstance(kv, KeyValue)
        out[kv.key] = _value(kv.value)
    return out


@dataclass(frozen=True)
class Span:
    """One received span."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    """The OTLP enum: 1 internal, 2 server, 3 client, 4 producer, 5 consumer."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]]
    status_code: int
    """0 unset, 1 ok, 2 error."""


INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    metrics: dict[str, list[Any]] = field(default_factory=dict)
    """Data points by metric name."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(self, req: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attrs(s.attributes),
                            resource=resource,
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            status_code=s.status.code,
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def add_metrics(self, req: ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        points = list(getattr(m, kind).data_points) if kind else []
                        self.metrics.setdefault(m.name, []).extend(points)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


class OtlpReceiver:
    """The receiver, on a free loopback port; `url` is what `OTEL_EXPORTER_OTLP_ENDPOINT` takes."""

    def __init__(self) -> None:
        self.received = Received()
        self.requests = 0
        received = self.received
        owner = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                answer: Callable[[], bytes]
                if self.path == "/v1/traces":
                    received.add_traces(ExportTraceServiceRequest.FromString(body))
                    answer = ExportTraceServiceResponse().SerializeToString
                elif self.path == "/v1/metrics":
                    received.add_metrics(ExportMetricsServiceRequest.FromString(body))
                    answer = ExportMetricsServiceResponse().SerializeToString
                else:
                    self.reply(404)
                    return
                owner.requests += 1
                self.reply(200, answer(), "application/x-protobuf")

        self.server, self.thread, self.url = serve_in_thread(Handler)
        self.thread.start()

    def env(self) -> dict[str, str]:
        """What a traced process of a test is started with: this endpoint, fast exports."""
        return {
            "ROLLOUTS_OTEL_ENABLED": "1",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
        }

    def spans(self, name: str | None = None) -> list[Span]:
        return [s for s in self.received.snapshot() if name is None or s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
