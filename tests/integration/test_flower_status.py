"""Flower's HTTP API sees a run's tasks by their args (fixed task names, so worker stats stay
small); `rollouts status --json` matches the files."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from examples.agent_server import AgentKnobs
from infra.embedded import free_port
from schemas import fields as F
from tests.helpers import demo_rows, read_jsonl
from tests.ops_helpers import cli, cli_background, manifest, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

FIXED_NAMES = {"rollouts.collect", "rollouts.collect_reply", "rollouts.finish"}


def flower_get(port: int, path: str) -> Any:
    response = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
    response.raise_for_status()
    return response.json()


def test_flower_finds_the_runs_tasks_and_status_matches_the_files(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    run = make_run(knobs=AgentKnobs(latency_ms=400), workers=0)
    out = run.out
    port = free_port()
    flower = cli_background(
        "flower", "--broker", redis_url, "--port", str(port), "--unauthenticated-api",
        log=tmp_path / "flower.log",
    )  # fmt: skip
    try:
        run.workers.start(concurrency=4, extra=["-E"])

        def flower_up() -> bool:
            try:
                return isinstance(flower_get(port, "/api/workers"), dict)
            except httpx.HTTPError:
                return False

        wait_for(flower_up, 60, "Flower to answer")
        # The broker reaches Flower through its environment: no URL (and no password) in `ps`.
        argv = Path(f"/proc/{flower.pid}/cmdline").read_bytes().decode().split("\0")
        assert "flower" in argv and not any(redis_url in a for a in argv), argv
        rows = demo_rows(40)
        rows[5]["fault"] = {"kind": "http500", "times": 9}
        rows[6]["fault"] = {"kind": "list", "times": 9}
        producer = run.start(rows, "+route_failures_to_sidecar=true")
        wait_for(lambda: (out / "rollouts-0_manifest.json").exists(), 30, "the manifest")
        run_id = manifest(out)["run_id"]

        def run_tasks() -> dict[str, Any]:
            tasks = flower_get(port, "/api/tasks")
            return {tid: t for tid, t in tasks.items() if f"run={run_id}" in (t.get("args") or "")}

        wait_for(lambda: len(run_tasks()) >= 3, 30, "the run's tasks in Flower", interval=0.5)
        in_flight = producer.poll() is None
        seen = run_tasks()
        names = flower_get(port, "/api/workers?refresh=1")
        assert any(name.startswith("test0-") for name in names), names
        assert producer.wait(120) == 0, run.log()

        def judged() -> list[str]:
            """The results of the run's rollout tasks that landed a result (its verdict in them)."""
            results = [str(t.get("result")) for t in run_tasks().values()
                       if t.get("name") == "rollouts.collect"]  # fmt: skip
            return [r for r in results if "'health'" in r]

        # Live health: each task's result in Flower carries its rollout's verdict.
        wait_for(lambda: len(judged()) >= 3, 30, "task results with verdicts", interval=0.5)
        verdicts = judged()
        # A worker's task counts are by name: a handful of keys, not one per rollout.
        stats = flower_get(port, "/api/workers?refresh=1")
        totals = {name: w["stats"]["total"] for name, w in stats.items() if "stats" in w}
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(20)
        run.servers.stop()
    assert in_flight, "the run ended before Flower was asked"
    assert all("'verdict': 'unobserved'" in result for result in verdicts), verdicts[:3]
    assert totals and all(set(total) <= FIXED_NAMES for total in totals.values()), totals
    assert sum(sum(total.values()) for total in totals.values()) >= 40, totals
    for task_id, task in seen.items():
        rid = task_id.rsplit(".", 1)[1]
        assert task["name"] == "rollouts.collect"
        assert f"run={run_id}" in task["args"] and f"rollout={rid}" in task["args"]
        assert "responses_create_params" not in task["args"]  # payloads stay out of events

    proc = cli("status", str(out), "--json", "--redis", redis_url)
    assert proc.returncode == 0, proc.stderr
    report = orjson.loads(proc.stdout)
    planned = read_jsonl(out / "rollouts-0_materialized_inputs.jsonl")
    results = read_jsonl(out / "rollouts-0.jsonl")
    failures = read_jsonl(out / "rollouts-0_failures.jsonl")
    assert report["state"] == "completed"
    assert report["planned"] == len(planned) == 40
    assert report["landed"] == len({(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in results}) == 38
    assert report["failed"] == dict(Counter(r[F.FAILURE_CLASS] for r in failures))
    assert report["failed"] == {"agent_run_error": 1, "agent_request_failed": 1}
    assert report["failure_rows"] == len(failures)
    assert (report["in_flight"], report["queued"], report["missing"]) == (0, 0, 0)
    by_agent = {
        agent: {
            "planned": sum(1 for r in planned if r[F.AGENT_REF]["name"] == agent),
            "landed": sum(1 for r in results if r[F.AGENT_REF]["name"] == agent),
        }
        for agent in ("math_agent", "count_agent")
    }
    for agent, counts in by_agent.items():
        assert report["by_agent"][agent]["planned"] == counts["planned"]
        assert report["by_agent"][agent]["landed"] == counts["landed"]
    # Row 5 went to count_agent (behind count_env), row 6 to math_agent (behind math_env).
    assert report["by_environment"]["count_env"]["failed"] == {"agent_run_error": 1}
    assert report["by_environment"]["math_env"]["failed"] == {"agent_request_failed": 1}
    assert report["by_agent"]["math_agent"]["failed"] == {"agent_request_failed": 1}

    proc = cli("status", str(out), "--watch", "--interval", "0.2", "--redis", redis_url)
    assert proc.returncode == 0, proc.stderr
    assert "40/40" in proc.stdout and "agent math_agent" in proc.stdout
    proc = cli("status", str(out))  # no Redis given: the recorded one is used
    assert proc.returncode == 0, proc.stderr
    assert (
        "planned 40 · landed 38 · failed agent_request_failed 1, agent_run_error 1" in proc.stdout
    )
