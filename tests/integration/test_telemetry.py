"""OpenTelemetry through real parts: a run's traces, decoded by an OTLP/HTTP receiver of the test.

The producer (`rollouts run --broker`, its own process) and two worker processes export to the
receiver; the example agent logs the `traceparent` each `/run` request carried. One run: one job
span, a trace per rollout linked to it, holding that rollout's queue, admission, `/run` and
landing spans, the same trace id at the agent and in `rollouts-0.jsonl`. A worker SIGKILLed
mid-run: its rollouts, taken over and published again, keep their trace. The capture proxy
records a model call in the trace of the rollout that made it; a recorded `run_examples` call is
traced as a run is.
"""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from opentelemetry.trace import SpanKind

from examples.agent_server import AgentKnobs
from infra.capture import CaptureStore
from infra.capture_proxy import CaptureProxy
from infra.telemetry import TraceParent
from schemas import fields as F
from tests.helpers import demo_rows, math_rows, read_jsonl, serve_app
from tests.ops_helpers import key, landed_lines, request_log, wait_for
from tests.otlp_receiver import CLIENT, CONSUMER, PRODUCER, OtlpReceiver, Span, in_memory_sdk
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

Key = tuple[int, int]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def by_trace(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        out[s.trace_id].append(s)
    return out


def rollout_key(span: Span) -> Key:
    return int(span.attributes["rollouts.task_index"]), int(
        span.attributes["rollouts.rollout_index"]
    )


def agent_traceparents(log: Path) -> dict[Key, list[TraceParent]]:
    """The `traceparent` of each `/run` request the example agent received, by rollout."""
    out: dict[Key, list[TraceParent]] = defaultdict(list)
    for e in request_log(log):
        if e["event"] == "start":
            parsed = TraceParent.parse(e.get("traceparent"))
            assert parsed is not None, f"a /run request came without a traceparent: {e}"
            out[(e["task"], e["rollout"])].append(parsed)
    return out


def names(spans: list[Span]) -> list[str]:
    return sorted(s.name for s in spans)


@pytest.mark.timeout(180)
def test_a_run_is_one_job_span_and_one_linked_trace_per_rollout(
    make_run: MakeRun, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    # The workers are asked by their environment; the producer by the run setting.
    env = receiver.env()
    run = make_run(knobs=AgentKnobs(request_log=str(log)), workers=2, concurrency=16, env=env)
    out = run.out
    producer_env = {k: v for k, v in env.items() if k != "ROLLOUTS_OTEL_ENABLED"}
    done = run.cli(demo_rows(50), "+telemetry_enabled=true", env=producer_env)
    assert done.returncode == 0, done.stdout + done.stderr
    run.servers.stop()

    def exported() -> bool:
        return len(receiver.spans("rollouts.land")) >= 50 and bool(
            receiver.spans("rollouts.health_check")
        )

    wait_for(exported, 30, "the workers' spans")
    spans = receiver.spans()
    [job] = [s for s in spans if s.name == "gym.job"]
    assert job.resource["service.name"] == "rollouts/producer"
    run_id = job.attributes["run_id"]
    assert job.resource["run_id"] == run_id and job.attributes["rollouts.planned"] == 50

    # One trace per rollout, its root the producer's enqueue span, linked to the job span.
    roots = [s for s in spans if s.name == "rollouts.enqueue"]
    assert len(roots) == 50 and len({s.trace_id for s in roots}) == 50
    traces = by_trace(spans)
    trace_of: dict[Key, str] = {}
    for root in roots:
        assert root.kind == PRODUCER and root.parent_span_id == ""
        assert root.links == [(job.trace_id, job.span_id)]
        assert root.trace_id != job.trace_id
        trace_of[rollout_key(root)] = root.trace_id
        trace = traces[root.trace_id]
        worker = [s for s in trace if s is not root]
        assert {s.resource["service.name"] for s in worker} == {"rollouts/worker"}
        for name in ("rollouts.queue_wait", "rollouts.collect", "rollouts.admission_wait",
                     "HTTP POST", "rollouts.land", "rollouts.land.lock_wait",
                     "rollouts.land.write"):  # fmt: skip
            assert name in names(trace), f"{name} missing from {names(trace)}"
        ids = {s.span_id: s for s in trace}
        [collect] = [s for s in trace if s.name == "rollouts.collect"]
        [queued] = [s for s in trace if s.name == "rollouts.queue_wait"]
        assert collect.kind == CONSUMER and collect.parent_span_id == root.span_id
        assert queued.parent_span_id == root.span_id and queued.start_ns == root.end_ns
        assert collect.attributes["rollouts.ended"] == "landed"
        assert collect.attributes["nemo.gym.rollout.id"] == root.attributes["nemo.gym.rollout.id"]
        [call] = [s for s in trace if s.name == "HTTP POST"]
        assert call.kind == CLIENT and call.parent_span_id == collect.span_id
        assert call.attributes["http.request.method"] == "POST"
        assert str(call.attributes["url.full"]).endswith("/run")
        assert call.attributes["http.response.status_code"] == 200
        for s in trace:  # every span of the rollout hangs from its root
            parent = s.parent_span_id
            while parent:
                parent = ids[parent].parent_span_id if parent in ids else "missing"
            assert parent == "", f"{s.name} is not under the rollout's root"

    # The agent was sent each rollout's trace, its parent the /run client span.
    sent = agent_traceparents(log)
    client_spans = {s.span_id for s in spans if s.name == "HTTP POST" and s.kind == CLIENT}
    assert set(sent) == set(trace_of)
    for k, parents in sent.items():
        assert [p.trace_id for p in parents] == [trace_of[k]]
        assert parents[0].span_id in client_spans

    # The landed rows carry their trace id.
    rows = read_jsonl(out / "rollouts-0.jsonl")
    assert len(rows) == 50
    assert {key(r): r[F.TRACE_ID] for r in rows} == trace_of

    # The finish step is in the job's trace: each /aggregate_metrics call, the health check.
    finish = traces[job.trace_id]
    [finishing] = [s for s in finish if s.name == "rollouts.finish"]
    assert finishing.parent_span_id == job.span_id
    aggregate = [s for s in finish if s.name == "HTTP POST"]
    assert len(aggregate) == 2
    assert all(str(s.attributes["url.full"]).endswith("/aggregate_metrics") for s in aggregate)
    assert all(s.parent_span_id == finishing.span_id for s in aggregate)
    assert "rollouts.health_check" in names(finish)

    # Metrics through the same SDK: rollouts landed, the /run latency histogram.
    wait_for(lambda: "rollouts.rollouts.ended" in receiver.received.metrics, 30, "metrics")
    assert "rollouts.run.duration" in receiver.received.metrics
    # Live health: each landed result's verdict, counted where it landed.
    assert "rollouts.health.verdicts" in receiver.received.metrics
    wait_for(lambda: "rollouts.queue.depth" in receiver.received.metrics, 30, "the queue depth")


@pytest.mark.timeout(180)
def test_a_rollout_taken_over_from_a_killed_worker_keeps_its_trace(
    make_run: MakeRun, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    planned = 80
    env = {**receiver.env(), "ROLLOUTS_LEASE_TTL_S": "3"}
    knobs = AgentKnobs(latency_ms=400, request_log=str(log))
    run = make_run(knobs=knobs, workers=2, env=env)
    out, workers = run.out, run.workers
    killed_pid = workers.procs[0].pid
    producer = run.start(demo_rows(planned), "+route_failures_to_sidecar=true", env=receiver.env())

    def exported_in_flight() -> set[Key]:
        """Rollouts the worker to kill has exported a delivery span of, whose `/run` call the
        agent has open, and that have not landed: what it holds mid-call whose spans reached
        the receiver (a span still in the exporter's queue at the kill dies with the process).
        A delivery still waiting for its turn, or a call already answered, may never be
        called again after the kill, so neither is a victim."""
        results = (out / "rollouts-0.jsonl").read_bytes().splitlines(keepends=True)
        landed_keys = {key(orjson.loads(line)) for line in results if line.endswith(b"\n")}
        delivered = receiver.spans("rollouts.queue_wait")
        mine = {rollout_key(s) for s in delivered if s.resource["process.pid"] == killed_pid}
        calls: dict[Key, int] = defaultdict(int)
        for e in request_log(log):
            calls[(e["task"], e["rollout"])] += 1 if e["event"] == "start" else -1
        open_calls = {k for k, n in calls.items() if n > 0}
        return (mine & open_calls) - landed_keys

    wait_for(lambda: landed_lines(out) >= 20, 60, "20 results")
    wait_for(lambda: bool(exported_in_flight()), 30, "an exported delivery mid-call")
    victims = exported_in_flight()
    workers.procs[0].send_signal(signal.SIGKILL)
    workers.procs[0].wait(10)
    code = producer.wait(150)
    run.servers.stop()
    assert code == 0, run.log()
    assert "went silent; published it again" in workers.logs[1].read_text()

    sent = agent_traceparents(log)
    again = {k: parents for k, parents in sent.items() if len(parents) > 1}
    assert again, "no rollout was called twice: the kill re-dispatched nothing"
    rows = {key(r): r for r in read_jsonl(out / "rollouts-0.jsonl")}
    assert len(rows) == planned

    def taken_over_landed() -> bool:
        # Not every rollout's landing span: the killed worker's last batch of spans (those ended
        # within an export delay of the kill) died with it. The taken-over rollouts landed on the
        # survivor, after the kill, and their spans are what is checked below.
        traces = by_trace(receiver.spans())
        return all(
            any(s.name == "rollouts.land" for s in traces.get(rows[k][F.TRACE_ID], ()))
            for k in again
        )

    wait_for(taken_over_landed, 30, "the taken-over rollouts' landing spans")
    traces = by_trace(receiver.spans())
    both: list[dict[str, Any]] = []
    for k, parents in again.items():
        # Both attempts carried the rollout's one trace, which its landed row names.
        assert {p.trace_id for p in parents} == {rows[k][F.TRACE_ID]}
        trace = traces[rows[k][F.TRACE_ID]]
        assert len([s for s in trace if s.name == "rollouts.enqueue"]) == 1
        deliveries = [s for s in trace if s.name == "rollouts.queue_wait"]
        pids = {s.resource["process.pid"] for s in deliveries}
        landed_by = {s.resource["process.pid"] for s in trace if s.name == "rollouts.land"}
        assert killed_pid not in landed_by and landed_by
        both.append({"key": k, "pids": pids, "deliveries": len(deliveries)})
    # The killed worker's first attempt left spans it exported before it died in the same trace
    # as the attempt that landed (a span still open at the kill is lost with the process).
    assert any(killed_pid in b["pids"] and len(b["pids"]) == 2 for b in both), (victims, both)


def test_the_capture_proxy_records_a_model_call_in_its_rollout_s_trace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spans = in_memory_sdk(monkeypatch)
    parent = TraceParent.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None
    seen: list[str | None] = []

    async def model(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        return web.json_response({"id": "resp-1", "output": [], "usage": {"input_tokens": 1}})

    async def go() -> None:
        upstream = web.Application()
        upstream.router.add_post("/v1/responses", model)
        model_runner, model_url = await serve_app(upstream)
        proxy = CaptureProxy(model_url, str(tmp_path / "capture"))
        proxy_runner, proxy_url = await serve_app(proxy.app())
        try:
            async with aiohttp.ClientSession() as session:
                for headers in ({"Traceparent": parent.header()}, {}):
                    url = proxy_url + "/ng-rollout/3-1/v1/responses"
                    async with session.post(url, json={"input": "hi"}, headers=headers) as r:
                        assert r.status == 200 and await r.read()
        finally:
            await proxy_runner.cleanup()
            await model_runner.cleanup()

    asyncio.run(go())
    call, served = spans.get_finished_spans()  # the untraced second call recorded nothing
    assert served.name == "gym.model.responses" and served.kind is SpanKind.SERVER
    assert served.parent is not None and f"{served.parent.span_id:016x}" == parent.span_id
    assert (served.attributes or {})["nemo.gym.rollout.id"] == "3-1"
    assert call.name == "HTTP POST" and call.kind is SpanKind.CLIENT
    assert call.parent is not None and call.parent.span_id == served.context.span_id
    # The model server got the upstream call's traceparent in place of the caller's; the
    # untraced call none.
    sent = TraceParent.parse(seen[0])
    assert sent is not None and (sent.trace_id, sent.span_id) == (
        parent.trace_id, f"{call.context.span_id:016x}",
    )  # fmt: skip
    assert seen[1] is None
    captured, _ = CaptureStore(str(tmp_path / "capture")).read("3-1")
    assert captured is not None and len(captured.splitlines()) == 2


@pytest.mark.timeout(120)
def test_a_recorded_python_api_call_is_a_job_span_and_a_trace_per_rollout(
    make_run: MakeRun, redis_url: str, receiver: OtlpReceiver, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`run_examples` in this process (traced in memory), its rollouts on a worker process."""
    from producer import preprocess_examples, run_examples
    from schemas.settings import CollectionSettings

    producer_spans = in_memory_sdk(monkeypatch)
    log = tmp_path / "requests.jsonl"
    knobs = AgentKnobs(request_log=str(log))
    run = make_run({"math_agent": "math_env"}, knobs, env=receiver.env())
    servers, out = run.servers, run.out
    rows = preprocess_examples(math_rows(6), servers.config(), CollectionSettings())

    async def go() -> list[Any]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(out),
            settings={"telemetry_enabled": True},
        )  # fmt: skip
        try:
            return [await f for f in completions]
        finally:
            await completions.aclose()  # the call's finish step has run

    got = asyncio.run(go())
    servers.stop()
    assert len(got) == 6
    local = producer_spans.get_finished_spans()
    [job] = [s for s in local if s.name == "gym.job"]
    roots = {f"{s.context.trace_id:032x}": s for s in local if s.name == "rollouts.enqueue"}
    assert len(roots) == 6
    assert all(
        [ln.context.span_id for ln in s.links] == [job.context.span_id] for s in roots.values()
    )
    # The call's finish ran here, in the job's trace.
    job_trace = job.context.trace_id
    assert "rollouts.health_check" in [s.name for s in local if s.context.trace_id == job_trace]
    # A rollout's collect span ends after its land span and may reach the receiver in a later
    # export batch: wait for both.
    wait_for(
        lambda: len(receiver.spans("rollouts.land")) >= 6
        and len(receiver.spans("rollouts.collect")) >= 6,
        30, "the worker's spans",
    )  # fmt: skip
    collects = receiver.spans("rollouts.collect")
    assert {s.trace_id for s in collects} == set(roots)
    assert {s.attributes["rollouts.ended"] for s in collects} == {"landed"}
    assert {p.trace_id for ps in agent_traceparents(log).values() for p in ps} == set(roots)
    assert {r[F.TRACE_ID] for r in read_jsonl(out / "rollouts-0.jsonl")} == set(roots)
