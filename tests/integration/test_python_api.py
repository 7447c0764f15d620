"""The Python API (docs/reference/python-api.md) against real `celery worker` processes, Redis and the example agent."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from examples.tasks import make_row
from producer import (
    RolloutFailedError,
    RolloutFailureRecord,
    preprocess_examples,
    run_examples,
    run_outcomes,
)
from schemas import fields as F
from schemas.errors import PlanningError, UsageError
from schemas.messages import QUEUE
from schemas.settings import CollectionSettings
from tests.api_helpers import first, first_then_close
from tests.helpers import ROOT, agent_stats, read_object_jsonl
from tests.ops_helpers import cli, manifest, request_log, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

SLOW_MS = 60_000


def planned(servers: RunningServers, n: int, repeats: int = 1) -> list[dict[str, Any]]:
    raw = [make_row("arithmetic", i, "math_agent") for i in range(n)]
    return preprocess_examples(raw, servers.config(), CollectionSettings(num_repeats=repeats))


def with_latency(rows: list[dict[str, Any]], fast: int, slow_ms: float = SLOW_MS) -> None:
    """The first `fast` rows answer at once, the others after `slow_ms`."""
    for i, row in enumerate(rows):
        row["agent_latency_ms"] = 0 if i < fast else slow_ms


def key(row: dict[str, Any]) -> tuple[int, int]:
    return F.rollout_key(row)


def math_agent(
    make_run: MakeRun,
    tmp_path: Path,
    latency_ms: float = 0.0,
    workers: int = 1,
    concurrency: int = 8,
) -> RunningServers:
    """The math agent alone, logging its requests to `agent.log`, and `workers` started."""
    log = str(tmp_path / "agent.log")
    knobs = AgentKnobs(latency_ms, request_log=log)
    return make_run(
        {"math_agent": "math_env"}, knobs, workers=workers, concurrency=concurrency
    ).servers


def test_results_arrive_in_completion_order(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path)
    rows = planned(servers, 6)
    for i, row in enumerate(rows):  # row 0 is the slow one; the others finish in their order
        row["agent_latency_ms"] = 1500 if i == 0 else 150 * i

    async def consume() -> list[tuple[dict[str, Any], Any]]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, enrich_results=True
        )
        try:
            return [await future for future in completions]
        finally:
            await completions.aclose()

    got = asyncio.run(consume())
    time.sleep(0.2)  # the workers' batched slot releases
    left = redis.Redis.from_url(redis_url).keys("rollouts:*")
    servers.stop()
    assert [row[F.TASK_INDEX] for row, _ in got] == [1, 2, 3, 4, 5, 0]
    assert left == []  # a call that settled every row leaves no state in Redis
    for row, result in got:
        # A copy the call owns, equal to the row given: never the caller's own object.
        assert not any(row is given for given in rows) and row == rows[row[F.TASK_INDEX]]
        assert key(result) == key(row) and result["reward"] in (0.0, 1.0)
        perf = result["ng_perf"]
        assert perf["rollout_latency_ms"] >= row["agent_latency_ms"]
        assert perf["queue_wait_ms"] >= 0


def test_aclose_after_10_of_100_closes_running_calls_and_starts_nothing_more(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path)
    agent = servers.urls["math_agent"]
    rows = planned(servers, 100)
    with_latency(rows, fast=10)

    async def go() -> tuple[list[Any], float]:
        completions = run_examples(rows, servers.config(), broker_url=redis_url)
        got = await first(completions, 10)
        # Every worker thread now holds a slow /run call.
        await asyncio.to_thread(
            wait_for, lambda: agent_stats(servers, "math_agent")["in_flight"] == 8, 30, "8"
        )
        await completions.aclose()
        return got, time.time()

    got, closed_at = asyncio.run(go())
    stats = httpx.get(agent + "/stats").json()
    wait_for(lambda: agent_stats(servers, "math_agent")["in_flight"] == 0, 5, "calls closed")
    # The 82 rows still queued are taken by the worker and stop at admission.
    wait_for(lambda: r.llen(QUEUE) == 0, 60, "the queue to empty")
    time.sleep(1.0)
    final = httpx.get(agent + "/stats").json()
    ttls = {k: r.ttl(k) for k in r.keys("rollouts:*")}
    servers.stop()
    assert sorted(key(row) for row, _ in got) == [(i, 0) for i in range(10)]
    assert stats["requests"] == 18
    assert final["requests"] == 18 and final["cancelled"] == 8, final
    assert ttls and all(ttl > 0 for ttl in ttls.values()), ttls  # closed early: all expire
    events = request_log(tmp_path / "agent.log")
    assert not [e for e in events if e["event"] == "start" and e["start"] > closed_at]
    ends = [e for e in events if e["event"] == "end"]
    # The calls cancelled are exactly the slow ones that started. Which 8 they are is not fixed:
    # deliveries waiting for a slot take their leases on parallel step threads, so row 18 may
    # start before row 17. They come from the 10 slow rows the worker can hold at most (its 8
    # slots and a quarter of them lent: `workers/pool.py`).
    started = sorted(e["task"] for e in events if e["event"] == "start" and e["task"] >= 10)
    assert sorted(e["task"] for e in ends if e["outcome"] == "cancelled") == started
    assert len(started) == 8 and set(started) <= set(range(10, 20)), started


def test_aclose_and_drain_returns_the_completed_unconsumed_outcomes_once(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path)
    rows = planned(servers, 30)
    with_latency(rows, fast=14)

    def settled() -> bool:
        stats = agent_stats(servers, "math_agent")
        return bool(stats["completed"] == 14 and stats["in_flight"] == 8)

    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        completions = run_examples(rows, servers.config(), broker_url=redis_url)
        consumed = await first(completions, 10)
        await asyncio.to_thread(wait_for, settled, 30, "14 completed and 8 running")
        await asyncio.sleep(0.3)  # the 4 completed outcomes reach the caller
        drained = [await f for f in await completions.aclose_and_drain()]
        again = await completions.aclose_and_drain()
        return consumed, drained, again

    consumed, drained, again = asyncio.run(go())
    stats = agent_stats(servers, "math_agent")
    servers.stop()
    consumed_keys = {key(row) for row, _ in consumed}
    assert sorted(key(row) for row, _ in drained) == sorted(
        {(i, 0) for i in range(14)} - consumed_keys
    )
    assert all(key(result) == key(row) and "reward" in result for row, result in drained)
    assert again == []
    assert stats["cancelled"] == 8 and stats["requests"] == 22


def test_max_resident_tasks_caps_rollouts_running_at_once(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path, latency_ms=300, concurrency=16)
    rows = planned(servers, 24)

    async def go() -> tuple[int, list[Any]]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, max_resident_tasks=4
        )
        first = next(completions)
        await asyncio.sleep(0.5)
        before = agent_stats(servers, "math_agent")["requests"]
        results = [await first] + [await future for future in completions]
        await completions.aclose()
        return before, results

    before, results = asyncio.run(go())
    stats = agent_stats(servers, "math_agent")
    servers.stop()
    assert before == 0  # admission starts at the first await
    assert sorted(key(row) for row, _ in results) == [(i, 0) for i in range(24)]
    assert stats["requests"] == 24
    assert stats["max_in_flight"] == 4


def test_recorded_shard_passes_health_check_and_resume_runs_only_what_it_lacks(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    # Rows without their own latency take the agent's (slow while recording, then instant).
    servers = math_agent(make_run, tmp_path, latency_ms=SLOW_MS)
    agent = servers.urls["math_agent"]
    out = tmp_path / "run"
    rows = planned(servers, 10, repeats=2)
    for row in rows[:8]:
        row["agent_latency_ms"] = 0

    got, finished = first_then_close(
        rows, servers.config(), 8, broker_url=redis_url, record_output_dir=str(out),
        record_shard="step1", settings={"max_failed_fraction": 0.1},
    )  # fmt: skip
    status = cli("status", str(out), "--shard", "step1", "--json", "--redis", redis_url)
    check = cli("health-check", str(out))
    first_summary = orjson.loads((out / "quality_summary.json").read_bytes())["run"]
    resumed_at = time.time()
    httpx.post(agent + "/admin/knobs", json={"latency_ms": 0})
    resume = cli("resume", str(out), "--shard", "step1", "--broker", redis_url)
    recheck = cli("health-check", str(out))
    servers.stop()
    m = manifest(out, "step1")
    materialized = [
        orjson.loads(x)
        for x in (out / "rollouts-step1_materialized_inputs.jsonl").read_bytes().splitlines()
    ]
    assert [key(r) for r in materialized] == [key(r) for r in rows]
    assert {(r[F.RUN_ID], r[F.SHARD]) for r in materialized} == {(m["run_id"], "step1")}
    assert finished is not None and finished.state == "cancelled" and finished.landed == 8
    assert [g["kind"] for g in m["generations"]] == ["run", "resume"]
    assert m["state"] == "completed", m

    assert status.returncode == 0, status.stderr
    report = orjson.loads(status.stdout)
    assert (report["planned"], report["landed"]) == (20, 8)
    assert check.returncode == 0, check.stdout + check.stderr
    accounting = first_summary["accounting"]
    assert (accounting["owed"], accounting["landed"], accounting["missing"]) == (20, 8, 12)
    assert (accounting["duplicates"], accounting["unreadable"]) == (0, 0)

    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert "running 12" in resume.stdout
    events = [e for e in request_log(tmp_path / "agent.log") if e["event"] == "start"]
    landed_first = {key(row) for row, _ in got}
    assert {(e["task"], e["rollout"]) for e in events if e["start"] > resumed_at} == {
        key(r) for r in rows
    } - landed_first
    assert recheck.returncode == 0, recheck.stdout + recheck.stderr
    summary = orjson.loads((out / "quality_summary.json").read_bytes())["run"]
    assert summary["accounting"]["landed"] == 20 and summary["healthy"] is True, summary


def test_failures_become_records_or_errors_and_budget_drains_before_any_call(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path)
    config = servers.config()
    rows = planned(servers, 5)
    for i, fault in {1: "http500", 2: "malformed", 3: "list", 4: "reset"}.items():
        rows[i]["fault"] = {"kind": fault, "times": 99}

    async def outcomes() -> list[Any]:
        it = run_outcomes(
            rows, config, broker_url=redis_url, retry_requests=False, run_id="trainer-7"
        )
        try:
            return [pair async for pair in it]
        finally:
            await it.aclose()

    async def examples() -> list[Any]:
        completions = run_examples(rows, config, broker_url=redis_url)
        try:
            return await asyncio.gather(*completions, return_exceptions=True)
        finally:
            await completions.aclose()

    async def drained(records: bool) -> list[Any]:
        call: Callable[..., Any] = run_outcomes if records else run_examples
        it = call(rows, config, broker_url=redis_url, dispatch_budget_s=0)
        try:
            return [pair async for pair in it] if records else [await f for f in it]
        finally:
            await it.aclose()

    got = {key(row): result for row, result in asyncio.run(outcomes())}
    raised = asyncio.run(examples())
    requests = agent_stats(servers, "math_agent")["requests"]
    budget_rows = asyncio.run(drained(False))
    budget_records = asyncio.run(drained(True))
    with pytest.raises(PlanningError) as bad:
        run_examples([{"agent_ref": {"name": "math_agnt"}}, rows[0]], config)
    after = agent_stats(servers, "math_agent")["requests"]
    servers.stop()
    assert "reward" in got[(0, 0)]
    records = {k: v for k, v in got.items() if isinstance(v, RolloutFailureRecord)}
    assert sorted(records) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    summary = {
        k[0]: (r.failure_class, r.exception_type, r.http_status, r.delivery, r.failure.failure_kind)
        for k, r in records.items()
    }
    assert summary == {
        1: ("agent_run_error", "HTTPStatusError", 500, "delivered", "agent_run_error"),
        2: ("agent_request_failed", "JSONDecodeError", 200, "delivered", "agent_request_failed"),
        3: ("agent_request_failed", "InvalidResultShape", 200, "delivered", "agent_request_failed"),
        4: ("agent_request_failed", "RemoteProtocolError", None, "possibly_delivered",
            "transport_peer_drop"),
    }  # fmt: skip
    assert {r.run_id for r in records.values()} == {"trainer-7"}
    assert records[(1, 0)].episode_id.rollout_id == "1-0"
    assert "injected fault" in (records[(1, 0)].response_body or "")

    # route_failures_to_sidecar off: the failed row's awaitable raises, the others resolve.
    errors = [x for x in raised if isinstance(x, BaseException)]
    assert all(isinstance(x, RolloutFailedError) for x in errors) and len(errors) == 4
    http = next(x for x in errors if isinstance(x, RolloutFailedError) and key(x.row) == (1, 0))
    assert http.failure is not None and http.failure[F.FAILURE_HTTP_STATUS] == 500
    assert [key(p[0]) for p in raised if isinstance(p, tuple)] == [(0, 0)]

    # A budget already spent: nothing reaches the agent, every row resolves to the drained row.
    assert after == requests
    assert [r["error_message"] for _, r in budget_rows] == [
        "not dispatched: dispatch budget exhausted"
    ] * 5
    assert all(r[F.DISPATCH_DRAINED] and r[F.NO_PERSIST] for _, r in budget_rows)
    assert {(r.dispatch_drained, r.delivery) for _, r in budget_records} == {(True, "not_sent")}
    text = str(bad.value)
    assert "<rows>:1" in text and "did you mean 'math_agent'" in text
    assert "responses_create_params" in text


def test_example_trainer_loop_stops_early() -> None:
    assert len((ROOT / "examples" / "trainer_loop.py").read_text().splitlines()) < 40
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.trainer_loop"],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"stopped early: (\d+) rollouts used, (\d+) of 64 rows sent", proc.stdout)
    assert found is not None, proc.stdout
    # 16 taken. At most 8 are resident at once, so those sent beyond the 16 are the ones running
    # when the loop stopped, and the few that ended and started again while its results and
    # then its cancellation were on their way (the agent answers at once: 17-25 sent in 34 runs
    # on a quiet machine). Without the early stop all 64 are sent.
    assert int(found[1]) == 16 and 16 <= int(found[2]) <= 32


def test_a_fully_consumed_call_records_a_completed_shard_on_s3(
    make_run: MakeRun, redis_url: str, tmp_path: Path, s3_bucket: str
) -> None:
    servers = math_agent(make_run, tmp_path)
    out = f"{s3_bucket}/runs/api"
    rows = planned(servers, 3, repeats=2)

    async def go() -> tuple[list[Any], Any]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=out,
            settings={"max_failed_fraction": 0.1},
        )  # fmt: skip
        got = [await future for future in completions]
        await completions.aclose()
        return got, completions.finished

    got, finished = asyncio.run(go())
    check = cli("health-check", out)
    servers.stop()
    assert len(got) == 6 and finished is not None and finished.state == "completed"
    assert finished.health is not None and finished.health["healthy"] is True
    results = read_object_jsonl(out, "rollouts-0.jsonl")  # one plain object, compacted
    assert sorted(key(r) for r in results) == sorted(key(r) for r in rows)
    assert {r[F.RUN_ID] for r in results} == {
        read_object_jsonl(out, "rollouts-0_materialized_inputs.jsonl")[0][F.RUN_ID]
    }
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Rollout health: 6 checked" in check.stdout


def test_a_reply_too_deep_to_store_is_a_result_not_stored_failure_recorded_or_not(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = make_run({"math_agent": "math_env"}, AgentKnobs(deep_reply_every=2)).servers
    config = servers.config()
    out = tmp_path / "recorded"
    rows = planned(servers, 4)

    async def outcomes(**recording: Any) -> dict[tuple[int, int], Any]:
        it = run_outcomes(rows, config, broker_url=redis_url, **recording)
        try:
            return {key(row): result async for row, result in it}
        finally:
            await it.aclose()

    unrecorded = asyncio.run(asyncio.wait_for(outcomes(), 120))
    recorded = asyncio.run(
        asyncio.wait_for(outcomes(record_output_dir=str(out), record_shard="deep"), 120)
    )
    servers.stop()
    for got in (unrecorded, recorded):
        assert sorted(got) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # every rollout has its outcome
        assert "reward" in got[(1, 0)] and "reward" in got[(3, 0)]
        for k in ((0, 0), (2, 0)):
            failure = got[k]
            assert isinstance(failure, RolloutFailureRecord)
            assert failure.failure_class == "result_not_stored"
            assert failure.exception_type == "JSONEncodeError"
    landed = [orjson.loads(x) for x in (out / "rollouts-deep.jsonl").read_bytes().splitlines()]
    assert sorted(key(row) for row in landed) == [(1, 0), (3, 0)]
    sidecar = (out / "rollouts-deep_failures.jsonl").read_bytes().splitlines()
    assert sorted(key(orjson.loads(x)) for x in sidecar) == [(0, 0), (2, 0)]


def test_an_unreachable_cluster_is_one_usage_error_before_anything_is_dispatched(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = math_agent(make_run, tmp_path, workers=0)
    rows = planned(servers, 2)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"redis://:hunter2@127.0.0.1:{port}/0"
    out = tmp_path / "run"
    with pytest.raises(UsageError) as info:
        run_examples(rows, servers.config(), broker_url=dead, record_output_dir=str(out))
    message = str(info.value)
    assert message.startswith(f"broker_url= redis://:***@127.0.0.1:{port}/0: cannot use this")
    assert "hunter2" not in message and "\n" not in message
    with pytest.raises(UsageError, match=r"^redis_url= redis://127\.0\.0\.1:\d+/0: cannot"):
        run_examples(
            rows, servers.config(), broker_url=redis_url,
            redis_url=f"redis://127.0.0.1:{port}/0",
        )  # fmt: skip
    assert not out.exists()
    assert redis.Redis.from_url(redis_url).llen(QUEUE) == 0
    assert agent_stats(servers, "math_agent")["requests"] == 0
    servers.stop()
