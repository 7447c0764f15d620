"""Task sets end to end (issue 38): flat rows and materialized task rows of two task sets on two
environment servers in one run, through real worker processes, Redis and the example servers.

The environment servers record every `/run` body they receive, so the test reads the episode
requests as NeMo Gym's collector would have sent them; the run is cut by a SIGKILL of its producer
and of its worker mid-run and finished by `rollouts resume`; `status`, `report`, `aggregate` and the
Python API then work on it.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from examples.tasks import task_row
from producer import RolloutFailureRecord, preprocess_examples, run_examples, run_outcomes
from schemas import fields as F
from tests.helpers import demo_rows, read_jsonl
from tests.ops_helpers import cli, key, landed_lines, manifest, rows_by_key, wait_for
from tests.runs import MakeRun, Run

pytestmark = pytest.mark.integration

TASKSETS = {"arith:v1": "arith_tasks", "count:v1": "count_tasks"}
FAILING = ("count:v1", "count-0003")
"""The task whose episodes the environment server fails, terminally."""


def mixed_rows(latency_ms: float = 0) -> list[dict[str, Any]]:
    """6 flat rows (two agents), 5 tasks of `arith:v1`, 4 of `count:v1` (the last one failing)."""
    arith = [task_row("arith:v1", "arithmetic", i, latency_ms=latency_ms) for i in range(5)]
    count = [task_row("count:v1", "counting", i, latency_ms=latency_ms) for i in range(4)]
    count[3]["task_input"]["fail"] = {"terminal": True, "reason": "the sandbox would not start"}
    return [*demo_rows(6), *arith, *count]


def task_run(make_run: MakeRun, latency_ms: float = 0, concurrency: int = 8) -> Run:
    """The demo servers and the two task sets' environment servers, every one of them answering
    HTTP 411 to a request body without a Content-Length; and a worker."""
    knobs = AgentKnobs(latency_ms=latency_ms)
    run = make_run(knobs=knobs, tasksets=TASKSETS, concurrency=concurrency)
    for env in run.servers.environments.values():
        env.require_content_length = True
    return run


def episodes(servers: RunningServers, env: str) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = httpx.get(servers.urls[env] + "/episodes").json()
    return bodies


def failing(row: dict[str, Any]) -> bool:
    task = row.get(F.TASK_ID) if F.is_task_row(row) else row.get(F.NG_TASK_ID)
    return isinstance(task, dict) and (task["taskset"], task["task_id"]) == FAILING


@pytest.mark.timeout(300)
def test_a_run_mixing_flat_rows_and_two_task_sets_survives_a_producer_sigkill(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    run = task_run(make_run, latency_ms=250, concurrency=3)
    servers, out = run.servers, run.out
    producer = run.start(
        mixed_rows(latency_ms=250), "--num-repeats", "2", "+route_failures_to_sidecar=true"
    )
    results = out / "rollouts-0.jsonl"
    wait_for(lambda: landed_lines(out) >= 10, 60, "10 results")
    # The producer and the only worker die mid-run (the machine went away).
    producer.send_signal(signal.SIGKILL)
    producer.wait(10)
    run.workers.stop(graceful=False)
    assert manifest(out)["state"] == "running"
    landed_before = landed_lines(out)
    assert landed_before < 28
    run.workers.start()
    proc = cli("resume", str(out), "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    planned = read_jsonl(out / "rollouts-0_materialized_inputs.jsonl")
    # Round-robin across the four servers that run rows (interleave_by_agent, on for run).
    assert len({F.dispatch_target(r) for r in planned[:4]}) == 4
    status = orjson.loads(cli("status", str(out), "--json").stdout)
    report = cli("report", str(out), "--output", str(tmp_path / "report.html"))
    merged = tmp_path / "merged" / "all.jsonl"
    aggregated = cli("aggregate", "-i", str(results), "-o", str(merged))
    bodies = {env: episodes(servers, env) for env in TASKSETS.values()}
    refused = sum(env.refused_chunked for env in servers.environments.values())
    servers.stop()

    # 15 tasks x 2 repeats: every rollout landed once, but the two of the failing task.
    assert len(planned) == 30
    landed = rows_by_key(results)
    assert all(len(v) == 1 for v in landed.values())
    assert set(landed) == {key(r) for r in planned if not failing(r)}
    failures = read_jsonl(out / "rollouts-0_failures.jsonl")
    assert {key(f) for f in failures} == {key(r) for r in planned if failing(r)}
    for f in failures:  # terminal: the resume did not run them again
        assert f[F.FAILURE_CLASS] == "environment_server_failed" and f[F.FAILURE_TERMINAL]
        assert f[F.FAILURE_MESSAGE] == "the sandbox would not start"
        assert f[F.NG_TASK_ID] == {"taskset": FAILING[0], "task_id": FAILING[1]}
        assert f[F.ENVIRONMENT_SERVER] == "count_tasks"

    # NeMo Gym's episode bodies, exactly, for every planned task row (once, or again on resume).
    by_key = {key(r): r for r in planned}
    for taskset, env in TASKSETS.items():
        wanted = [r for r in planned if F.taskset_of(r) == taskset]
        assert {r[F.ENVIRONMENT_SERVER] for r in wanted} == {env}
        sent = Counter(orjson.dumps(b, option=orjson.OPT_SORT_KEYS) for b in bodies[env])
        expected = {
            orjson.dumps(
                {
                    "episode_id": {"rollout_id": f"{r[F.TASK_INDEX]}-{r[F.ROLLOUT_INDEX]}",
                                   "attempt": 0},
                    "task": {"task_id": r[F.TASK_ID], "task_input": r[F.TASK_INPUT]},
                },
                option=orjson.OPT_SORT_KEYS,
            )
            for r in wanted
        }  # fmt: skip
        assert set(sent) == expected
        assert all(n <= 2 for n in sent.values())  # a second time only if the kill cut it
    for k, [result] in landed.items():
        row = by_key[k]
        if F.is_task_row(row):
            assert result[F.NG_TASK_ID] == row[F.TASK_ID]
            assert F.AGENT_REF not in result and "reward" in result
        assert result[F.ENVIRONMENT_SERVER] == row[F.ENVIRONMENT_SERVER]

    # One aggregate entry per environment server, the task sets' labelled by their server.
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert [(e["_ng_environment_server"], e["agent_ref"]["name"]) for e in entries] == [
        ("arith_tasks", "arith_tasks"), ("count_env", "count_agent"),
        ("count_tasks", "count_tasks"), ("math_env", "math_agent"),
    ]  # fmt: skip
    counts = {e["_ng_environment_server"]: len(e["group_level_metrics"]) for e in entries}
    assert counts == {"arith_tasks": 5, "count_env": 3, "count_tasks": 3, "math_env": 3}
    assert all("aggregation_error" not in e for e in entries)
    assert refused == 0  # every request to an environment server had a Content-Length

    assert status["planned"] == 30 and status["landed"] == 28
    assert status["failed"] == {"environment_server_failed": 2}
    # Task rows are counted under their environment server (they name no agent).
    assert sorted(status["by_agent"]) == ["count_agent", "math_agent"]
    assert status["by_environment"]["arith_tasks"]["landed"] == 10
    assert status["by_environment"]["count_tasks"]["planned"] == 8
    assert report.returncode == 0, report.stdout + report.stderr
    assert (tmp_path / "report.html").stat().st_size > 0
    summary = orjson.loads((out / "quality_summary.json").read_bytes())["run"]
    assert summary["accounting"]["landed"] == 28 and summary["accounting"]["owed"] == 30
    assert aggregated.returncode == 0, aggregated.stdout + aggregated.stderr
    assert len(read_jsonl(merged)) == 28
    merged_entries = orjson.loads((merged.parent / "all_aggregate_metrics.json").read_bytes())
    assert [e["_ng_environment_server"] for e in merged_entries] == [
        "arith_tasks", "count_env", "count_tasks", "math_env"
    ]  # fmt: skip


def test_the_python_api_runs_task_rows_beside_flat_rows(make_run: MakeRun, redis_url: str) -> None:
    servers = task_run(make_run).servers
    config = servers.config()
    rows = preprocess_examples(mixed_rows(), config)
    assert [F.dispatch_target(r) for r in rows[6:8]] == ["arith_tasks", "arith_tasks"]

    async def consume() -> tuple[list[Any], list[Any]]:
        completions = run_examples(
            [r for r in rows if not failing(r)], config, broker_url=redis_url
        )
        try:
            examples = [await future for future in completions]
        finally:
            await completions.aclose()
        outcomes = run_outcomes(rows, config, broker_url=redis_url)
        try:
            return examples, [pair async for pair in outcomes]
        finally:
            await outcomes.aclose()

    examples, outcomes = asyncio.run(consume())
    bodies = episodes(servers, "count_tasks")
    servers.stop()
    assert len(examples) == 14
    for row, result in examples:
        assert result[F.TASK_INDEX] == row[F.TASK_INDEX]
        if F.is_task_row(row):
            assert result[F.NG_TASK_ID] == row[F.TASK_ID] and "reward" in result
    assert len(outcomes) == 15
    # The environment server's own failure row comes back as its result, as an agent's does.
    [(row, failed)] = [(r, o) for r, o in outcomes if failing(r)]
    assert not isinstance(failed, RolloutFailureRecord)
    assert failed[F.FAILURE_CLASS] == "environment_server_failed" and failed[F.FAILURE_TERMINAL]
    assert failed[F.NG_TASK_ID] == row[F.TASK_ID]
    first = {"rollout_id": f"{rows[-1][F.TASK_INDEX]}-0", "attempt": 0}
    assert first in [b["episode_id"] for b in bodies]


@pytest.mark.timeout(300)
def test_rollouts_demo_runs_its_task_set_and_finishes_all_green(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = cli(
        "demo", "--tasks", "12", "--repeats", "2", "--workers", "1", "--output-dir", str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "task set demo:word-counts on word_tasks_env" in proc.stdout
    assert "environment word_tasks_env\n" in proc.stdout  # labelled by itself: it has no agent
    landed = read_jsonl(out / "rollouts-0.jsonl")
    episodes_landed = [r for r in landed if F.NG_TASK_ID in r]
    assert len(landed) == 30 and len(episodes_landed) == 6  # 12 flat tasks, 3 task rows, x2
    assert {r[F.NG_TASK_ID]["taskset"] for r in episodes_landed} == {"demo:word-counts"}
    assert not (out / "rollouts-0_failures.jsonl").exists()
    run = orjson.loads((out / "quality_summary.json").read_bytes())["run"]
    assert run["healthy"] is True and run["verdicts"]["healthy"] == 30
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert [e["_ng_environment_server"] for e in entries] == ["count_env", "math_env",
                                                              "word_tasks_env"]  # fmt: skip
