"""The failure policy through real parts: replay rules, connect retries, worker_lost, strict modes."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from examples.agent_server import AgentKnobs, AgentServer
from examples.tasks import make_row
from infra.embedded import free_port
from schemas import fields as F
from schemas.errors import RunPartialError
from tests.helpers import agent_stats, demo_rows
from tests.ops_helpers import cli, manifest, requests_per_key, rows_by_key, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def test_retry_requests_off_does_not_replay_after_sending(
    make_run: MakeRun, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    run = make_run(knobs=AgentKnobs(request_log=str(log)))
    rows = demo_rows(6)
    for row, kind in zip(rows, ("hang", "http502", "reset"), strict=False):
        row["fault"] = {"kind": kind, "times": 9}
    out = run.out
    settings = {
        "route_failures_to_sidecar": True,
        "retry_requests": False,
        "rollout_timeout_s": 1.0,
    }
    code = run.execute(rows, settings)
    run.servers.stop()
    assert code == 0
    requests = requests_per_key(log)
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    results = rows_by_key(out / "rollouts-0.jsonl")
    for k in ((0, 0), (1, 0), (2, 0)):
        assert requests[k] == 1, k  # one request in the agent's own log: not replayed
        assert len(failures[k]) == 1
        assert failures[k][0][F.FAILURE_CLASS] == "agent_request_failed"
    assert failures[(0, 0)][0]["failure_kind"] == "agent_timeout"
    # The time limit did not kill the worker: it went on with the other rows.
    assert all(p.poll() is None for p in run.workers.procs)
    assert set(results) == {(3, 0), (4, 0), (5, 0)}


def test_a_connection_never_established_is_retried_with_backoff(
    make_run: MakeRun, tmp_path: Path
) -> None:
    # The late agent's socket is bound now and listens after a second: until then a connect is
    # refused. (Starting an agent process then made the wait its interpreter's start-up time, and
    # full-jitter backoff can sum to under that: P(8 retries < 4 s) is 1% a row.)
    late_sock = socket.socket()
    late_sock.bind(("127.0.0.1", 0))
    late_port, dead_port = late_sock.getsockname()[1], free_port()
    log = tmp_path / "late.jsonl"
    run = make_run(workers=0)
    config = run.servers.config()
    config["agents"]["late_agent"] = {
        "url": f"http://127.0.0.1:{late_port}", "type": "simple_agent", "environment": "math_env",
    }  # fmt: skip
    config["agents"]["dead_agent"] = {
        "url": f"http://127.0.0.1:{dead_port}", "type": "simple_agent", "environment": "math_env",
    }  # fmt: skip
    run.write_config(config)
    rows = [make_row("arithmetic", i, "late_agent") for i in range(3)]
    rows.append(make_row("arithmetic", 3, "dead_agent"))
    late = AgentServer("late_agent", AgentKnobs(request_log=str(log)))
    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, name="late-agent", daemon=True)
    serving.start()
    runner = web.AppRunner(late.app(), handler_cancellation=True, access_log=None)
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(30)

    def start_late_agent() -> None:
        asyncio.run_coroutine_threadsafe(web.SockSite(runner, late_sock).start(), loop).result(30)

    timer = threading.Timer(1.0, start_late_agent)
    run.workers.start()
    timer.start()
    out = run.out
    settings = {
        "route_failures_to_sidecar": True,
        "retry_requests": False,  # connect retries do not depend on it
        # Up to 25 s of backoff in all (about 13 s expected) before giving up.
        "connect_retries": 8,
        "retry_backoff_s": 0.1,
    }
    try:
        code = run.execute(rows, settings)
    finally:
        timer.cancel()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        serving.join(30)
        loop.close()
        late.close()
        late_sock.close()
    assert code == 0
    results = rows_by_key(out / "rollouts-0.jsonl")
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert set(results) == {(0, 0), (1, 0), (2, 0)}
    assert all(F.ATTEMPT_INDEX not in rows_[0] for rows_ in results.values())
    assert requests_per_key(log) == {(0, 0): 1, (1, 0): 1, (2, 0): 1}
    [dead] = failures[(3, 0)]
    assert dead[F.FAILURE_CLASS] == "agent_request_failed"
    assert dead["failure_kind"] == "transport_unreachable"
    assert dead[F.FAILURE_TYPE] == "ConnectError"
    assert dead[F.FAILURE_HTTP_STATUS] is None
    assert set(failures) == {(3, 0)}


def test_a_rollout_its_workers_keep_dying_on_becomes_worker_lost(
    make_run: MakeRun, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    # Short lease and visibility timeouts: a dead worker's rollout is taken over in seconds (its
    # message, redelivered by the broker meanwhile, is a copy and is acknowledged).
    env = {"ROLLOUTS_LEASE_TTL_S": "3", "ROLLOUTS_VISIBILITY_TIMEOUT_S": "3"}
    run = make_run(knobs=AgentKnobs(request_log=str(log)), concurrency=1, env=env)
    rows = demo_rows(2)
    rows[1]["fault"] = {"kind": "hang", "times": 99}
    out = run.out
    producer = run.start(rows, "+max_attempts=2", "+route_failures_to_sidecar=true")
    for death in (1, 2):

        def delivered(d: int = death) -> bool:
            return requests_per_key(log)[(1, 0)] == d

        wait_for(delivered, 60, f"delivery {death}")
        victim = run.workers.procs[-1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        run.workers.start(concurrency=1, env=env, wait=False)
    assert producer.wait(120) == 0, run.log()
    run.servers.stop()
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    [lost] = failures[(1, 0)]
    assert lost[F.FAILURE_CLASS] == "worker_lost"
    assert lost[F.FAILURE_TERMINAL] is True
    assert "died 2 times" in lost[F.FAILURE_MESSAGE]
    # Two deliveries reached the agent; the third was stopped before calling it.
    assert requests_per_key(log)[(1, 0)] == 2
    assert set(rows_by_key(out / "rollouts-0.jsonl")) == {(0, 0)}


def test_route_failures_off_fails_the_run_on_the_first_error(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run(concurrency=4)
    servers, out = run.servers, run.out
    rows = demo_rows(40)
    for row in rows:
        row["agent_latency_ms"] = 1500
    rows[2].update({"fault": {"kind": "http500", "times": 9}, "agent_latency_ms": 0})
    proc = run.cli(rows)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rollout 2-0 failed: agent_run_error: /run returned HTTP 500" in proc.stderr
    # The evidence row is written.
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert failures[(2, 0)][0][F.FAILURE_HTTP_STATUS] == 500
    # Nothing new started and the calls in flight were cancelled.
    stats = [agent_stats(servers, a) for a in servers.agents]
    assert sum(s["requests"] for s in stats) <= 6
    assert sum(s["cancelled"] for s in stats) >= 1
    assert not (out / "rollouts-0.jsonl").exists() or len(rows_by_key(out / "rollouts-0.jsonl")) < 4
    m = manifest(out)
    assert m["state"] == "failed"
    assert "rollout 2-0 failed" in m["error"]
    status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    assert status["drained"] == 0  # not started because the run failed: stopped, not drained
    report = orjson.loads(cli("status", str(out), "--json", "--redis", redis_url).stdout)
    assert report["stopped"] >= 30
    assert status["failed"] == {"agent_run_error": 1}


def test_require_complete_rejects_a_run_with_missing_results(make_run: MakeRun) -> None:
    run = make_run()
    rows = demo_rows(10)
    rows[3]["fault"] = {"kind": "http500", "times": 9}
    rows[7]["fault"] = {"kind": "list", "times": 9}
    out = run.out
    # Both missing rollouts can still run and this run made progress: a resume can complete it.
    with pytest.raises(RunPartialError, match=r"EVAL FAILED: 8/10 samples completed"):
        run.execute(rows, {"route_failures_to_sidecar": True, "require_complete": True})
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert entries, "the partial aggregate is written"
    for entry in entries:
        assert entry["complete"] is False
        assert entry["completion_rejected"].startswith("EVAL FAILED: 8/10")
        # Decided before the aggregate: no server was asked, no metric value is published.
        assert entry["agent_metrics"] == {} and entry["key_metrics"] == {}
        assert entry["group_level_metrics"] == [] and entry["coverage"]["coverage/failed"] == 2
    m = manifest(out)
    assert m["state"] == "failed"
    assert "EVAL FAILED" in m["error"]
