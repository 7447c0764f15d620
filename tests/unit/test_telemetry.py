"""Trace context propagation: `traceparent` parsing, the collect message's headers, the `/run`
request's header and span, the records' trace id, and the delivery's spans (in-memory SDK)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from celery import Celery
from celery.exceptions import Ignore
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from infra import telemetry
from infra.http import EventLoopThread
from infra.telemetry import ENQUEUED_AT, TRACEPARENT, TraceParent
from schemas import fields as F
from schemas.messages import COLLECT_TASK, QUEUE, CallPolicy
from schemas.outcomes import Ended, RolloutOutcome
from tests.engine_helpers import Harness, as_kept, limited, replies
from tests.helpers import ROOT
from tests.otlp_receiver import in_memory_sdk
from workers import tracing
from workers.redispatch import CollectTaskMessage, from_delivered, publisher
from workers.rollout.agent_call import call_run

PARENT = TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
ROW = {F.TASK_INDEX: 3, F.ROLLOUT_INDEX: 1, F.RUN_ID: "r1", "agent_ref": {"name": "a"}}
RUN = {"run_id": "r1", "shard": "0", "output_dir": "/x", "token": "t"}


@pytest.fixture
def off(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process without telemetry, whatever the environment says."""
    monkeypatch.setattr(telemetry, "_state", telemetry._State())
    telemetry._state.asked = False


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """This process traced, its spans kept in memory."""
    exporter = in_memory_sdk(monkeypatch)
    yield exporter
    exporter.clear()


@pytest.mark.parametrize(
    ("value", "trace_id"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "4bf92f3577b34da6a3ce929d0e0e4736"),
        (" 00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-00 ", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("not a traceparent", None),
        (None, None),
        (17, None),
    ],
)  # fmt: skip
def test_traceparent_parsing_follows_w3c(value: Any, trace_id: str | None) -> None:
    parsed = TraceParent.parse(value)
    assert (parsed.trace_id if parsed else None) == trace_id
    if parsed is not None:
        assert TraceParent.parse(parsed.header()) == parsed


def test_a_collect_message_keeps_its_trace_headers_through_its_lease_and_the_broker() -> None:
    assert PARENT is not None
    request = SimpleNamespace(
        id="t1", argsrepr="x", group="g", group_index=2, chord=None,
        traceparent=PARENT.header(), rollouts_enqueued_ns=123, other="ignored",
    )  # fmt: skip
    m = CollectTaskMessage.from_request(request, {"row": ROW})
    assert m.headers == {TRACEPARENT: PARENT.header(), ENQUEUED_AT: 123}
    assert CollectTaskMessage.from_json(json.loads(json.dumps(m.to_json()))) == m
    # A message stored by a worker without telemetry, or before it: no headers.
    untraced = SimpleNamespace(id="t1", argsrepr="", group="g", group_index=0, chord=None)
    assert CollectTaskMessage.from_request(untraced, {}).headers is None
    stored = {k: v for k, v in m.to_json().items() if k != "headers"}
    assert CollectTaskMessage.from_json(stored).headers is None

    # Published: the trace headers are message headers, as Celery's request shows them; the
    # sweep reads them back from the message as kombu's Redis transport keeps it.
    kept = as_kept(m)
    assert kept["headers"][TRACEPARENT] == PARENT.header()
    assert kept["headers"]["task"] == COLLECT_TASK
    again = from_delivered(kept)
    assert again is not None and again.headers == m.headers


def test_a_message_published_again_keeps_its_trace_with_a_new_publish_time() -> None:
    assert PARENT is not None
    app = Celery("t", broker="memory://", set_as_current=False)
    m = CollectTaskMessage("t1", {"row": ROW}, "x", "g", 0, None, {TRACEPARENT: PARENT.header(),
                           ENQUEUED_AT: 5})  # fmt: skip
    before = time.time_ns()
    publisher(app)(m.to_json())
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(QUEUE)
        message = queue.get(timeout=5)
        message.ack()
        queue.close()
    assert message.headers[TRACEPARENT] == PARENT.header()
    assert message.headers[ENQUEUED_AT] >= before
    app.close()


def test_without_the_sdk_the_delivered_traceparent_is_forwarded_and_stamped(off: None) -> None:
    assert PARENT is not None
    headers: dict[str, str] = {}
    telemetry.inject(headers)
    assert headers == {}
    result: dict[str, Any] = {"x": 1}
    failures: list[dict[str, Any]] = [{"y": 2}]
    tracing.stamp(result, failures)
    assert F.TRACE_ID not in result
    with telemetry.delivered(PARENT):
        telemetry.inject(headers)
        tracing.stamp(result, failures)
    assert headers == {TRACEPARENT: PARENT.header()}
    assert result[F.TRACE_ID] == failures[0][F.TRACE_ID] == PARENT.trace_id
    assert telemetry.current_parent() is None


def _agent(seen: list[httpx.Request], status: int = 200) -> httpx.AsyncClient:
    def reply(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json={"reward": 1.0})

    return httpx.AsyncClient(transport=httpx.MockTransport(reply))


POLICY = CallPolicy(timeout_s=5, max_attempts=2, retry_requests=True, backoff_base_s=0.0)


def test_without_the_sdk_run_requests_carry_the_delivered_traceparent(off: None) -> None:
    assert PARENT is not None
    seen: list[httpx.Request] = []
    asyncio.run(call_run(_agent(seen), "http://agent", ROW, POLICY))
    with telemetry.delivered(PARENT):
        asyncio.run(call_run(_agent(seen), "http://agent", ROW, POLICY))
    assert TRACEPARENT not in seen[0].headers
    assert seen[1].headers[TRACEPARENT] == PARENT.header()


def test_each_run_attempt_is_a_client_span_whose_traceparent_the_agent_gets(
    spans: InMemorySpanExporter,
) -> None:
    assert PARENT is not None
    seen: list[httpx.Request] = []
    asyncio.run(call_run(_agent(seen, 502), "http://agent:9/", ROW, POLICY))  # untraced
    assert spans.get_finished_spans() == () and TRACEPARENT not in seen[0].headers
    seen.clear()
    with telemetry.delivered(PARENT):
        outcome = asyncio.run(call_run(_agent(seen, 502), "http://agent:9/", ROW, POLICY))
    assert outcome.final_failure is not None and len(seen) == 2  # one replay of a 502
    attempts = spans.get_finished_spans()
    assert [s.name for s in attempts] == ["HTTP POST", "HTTP POST"]
    # NeMo Gym's rollout id is the capture key: a replay's has its attempt (`-a1`).
    for request, span, rid in zip(seen, attempts, ("3-1", "3-1-a1"), strict=True):
        sent = TraceParent.parse(request.headers[TRACEPARENT])
        ctx = span.get_span_context()
        assert (
            ctx is not None
            and sent is not None
            and sent.trace_id == PARENT.trace_id == f"{ctx.trace_id:032x}"
        )
        assert sent.span_id == f"{ctx.span_id:016x}"
        assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT.span_id
        attrs = span.attributes or {}
        assert attrs["url.full"] == "http://agent:9/run" and attrs["server.port"] == 9
        assert attrs["http.response.status_code"] == 502
        assert attrs["rollouts.failure_class"] == "agent_request_failed"
        assert attrs["nemo.gym.rollout.id"] == rid
        assert span.status.status_code is StatusCode.ERROR


def test_a_delivery_records_its_queue_wait_and_how_it_ended(spans: InMemorySpanExporter) -> None:
    assert PARENT is not None
    enqueued = time.time_ns() - 5_000_000
    request = SimpleNamespace(id="t1", traceparent=PARENT.header(), rollouts_enqueued_ns=enqueued,
                              delivery_info={"redelivered": True})  # fmt: skip
    payload = {"row": ROW, "run": RUN}
    with tracing.delivery(request, payload) as traced:
        assert telemetry.current_trace_id() == PARENT.trace_id
        with tracing.step("rollouts.admission_wait"):
            pass
        traced.ended(RolloutOutcome(rollout="3-1", ended=Ended.FAILED,
                                    record={F.FAILURE_CLASS: "agent_run_error"}))  # fmt: skip
    with pytest.raises(Ignore), tracing.delivery(request, payload) as traced:
        traced.ended(RolloutOutcome(rollout="3-1", ended=Ended.REDELIVERED))
        raise Ignore()
    queued, step, collect, _, copy = spans.get_finished_spans()
    assert queued.name == "rollouts.queue_wait" and queued.start_time == enqueued
    assert queued.end_time == collect.start_time
    assert step.parent is not None and step.parent.span_id == collect.context.span_id
    assert collect.parent is not None and f"{collect.parent.span_id:016x}" == PARENT.span_id
    attrs = collect.attributes or {}
    assert (
        attrs["rollouts.ended"] == "failed" and attrs["rollouts.failure_class"] == "agent_run_error"
    )
    assert attrs["rollouts.redelivered"] is True and attrs["run_id"] == "r1"
    assert collect.status.status_code is StatusCode.ERROR
    # A copy of a delivery, acknowledged with Ignore: no error.
    assert (copy.attributes or {})["rollouts.ended"] == "redelivered"
    assert copy.status.status_code is StatusCode.OK
    # A message without a traceparent: nothing recorded, nothing delivered.
    spans.clear()
    with tracing.delivery(SimpleNamespace(id="t2"), payload) as traced:
        assert telemetry.current_parent() is None
        traced.ended(RolloutOutcome(rollout="3-1", ended=Ended.LANDED))
    assert spans.get_finished_spans() == ()


def test_each_rollout_task_roots_its_own_trace_linked_to_the_job_span(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.job("r1", "0", "tok", 2) as job:
        first = job.enqueued(ROW, RUN, "t1")
        second = job.enqueued({**ROW, F.TASK_INDEX: 4}, RUN, "t2")
        callback = job.callback_headers()
    assert first is not None and second is not None and callback is not None
    a, b = TraceParent.parse(first[TRACEPARENT]), TraceParent.parse(second[TRACEPARENT])
    assert a is not None and b is not None and a.trace_id != b.trace_id
    roots = [s for s in spans.get_finished_spans() if s.name == "rollouts.enqueue"]
    [job_span] = [s for s in spans.get_finished_spans() if s.name == "gym.job"]
    jid = job_span.context
    finish = TraceParent.parse(callback[TRACEPARENT])
    assert finish is not None
    assert (finish.trace_id, finish.span_id) == (f"{jid.trace_id:032x}", f"{jid.span_id:016x}")
    for root, parent in zip(roots, (a, b), strict=True):
        assert root.parent is None and f"{root.context.trace_id:032x}" == parent.trace_id
        assert [link.context.span_id for link in root.links] == [jid.span_id]


def test_off_no_job_span_and_no_headers(off: None) -> None:
    with tracing.job("r1", "0", "tok", 1) as job:
        assert job is tracing.NO_JOB
        assert job.enqueued(ROW, RUN, "t1") is None and job.callback_headers() is None


WITHOUT_THE_SDK = """
import logging, sys
from types import SimpleNamespace

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"no module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, Blocked())
logging.basicConfig()
import producer.cli, workers.tasks  # everything imports without the extra
from infra import telemetry
from workers import tracing

assert telemetry.requested()
with tracing.job("r1", "0", "tok", 1) as job:
    assert job is tracing.NO_JOB and job.enqueued({}, {}, "t") is None
assert not telemetry.setup("worker") and not telemetry.requested()
tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
with tracing.delivery(SimpleNamespace(id="t", traceparent=tp), {"row": {}, "run": {}}) as d:
    headers, record = {}, {}
    telemetry.inject(headers)
    tracing.stamp(record, [])
    with tracing.step("rollouts.admission_wait"):
        pass
assert headers == {"traceparent": tp}, headers
assert record == {"_ng_trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}, record
assert "opentelemetry" not in sys.modules
print("ran without the SDK")
"""


def test_without_the_extra_the_code_runs_and_still_propagates() -> None:
    """The SDK blocked from import (as without `rollouts[telemetry]`), telemetry asked for."""
    env = {**os.environ, "ROLLOUTS_OTEL_ENABLED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_SDK], capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran without the SDK"
    assert "the OpenTelemetry SDK is not installed" in done.stderr


def test_a_traced_rollout_s_rate_limit_wait_is_a_span_between_its_attempts(
    spans: InMemorySpanExporter,
) -> None:
    assert PARENT is not None
    loop = EventLoopThread("test-telemetry")
    try:
        h = Harness(loop)
        h.handler = replies(limited(429, "1"), h.reply(200, {"reward": 1.0}))
        with telemetry.delivered(PARENT):
            out = h.run()
    finally:
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        loop.thread.join(5)
        loop.loop.close()
    assert out.ended is Ended.LANDED
    finished = spans.get_finished_spans()
    # Admitted, then admitted again after the wait (no new start): each try its own span.
    admissions = [s for s in finished if s.name == "rollouts.admission_wait"]
    assert [(s.attributes or {})["rollouts.readmit"] for s in admissions] == [False, True]
    assert all((s.attributes or {})["rollouts.admission.verdict"] == "run" for s in admissions)
    first, waited, second = [s for s in finished if s.name != "rollouts.admission_wait"]
    assert [first.name, waited.name, second.name] == ["HTTP POST", "rollouts.rate_limit_wait",
                                                      "HTTP POST"]  # fmt: skip
    assert admissions[1].start_time is not None and waited.end_time is not None
    assert waited.end_time <= admissions[1].start_time
    assert (first.attributes or {})["http.response.status_code"] == 429
    assert (waited.attributes or {})["rollouts.wait_s"] == 1.0
    assert first.end_time is not None and waited.start_time is not None
    assert first.end_time <= waited.start_time
    assert {f"{s.context.trace_id:032x}" for s in finished} == {PARENT.trace_id}
