"""The walking skeleton through real parts: Redis, worker processes, example servers over HTTP."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from examples.metrics import aggregate_metrics
from examples.servers import RunningServers
from infra.store import RunDir
from schemas import fields as F
from tests.helpers import agent_stats, demo_rows, read_object_jsonl
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def test_500_rollouts_land_exactly_once_and_aggregate(make_run: MakeRun, run_dir_url: str) -> None:
    run = make_run(workers=2, concurrency=32)
    servers, workers = run.servers, run.workers
    out = run_dir_url
    rd = RunDir(out)

    code = run.execute(demo_rows(125), {"num_repeats": 4}, output_dir=out)

    assert code == 0
    planned = read_object_jsonl(out, "rollouts-0_materialized_inputs.jsonl")
    results = read_object_jsonl(out, "rollouts-0.jsonl")
    # The finish step left every file as one object: no segments remain.
    assert rd.segments("rollouts-0.jsonl") == []
    assert len(planned) == 500
    keys = Counter((r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in results)
    assert set(keys) == {(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in planned}
    assert max(keys.values()) == 1
    by_key = {(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]): r for r in planned}
    for result in results:
        plan = by_key[(result[F.TASK_INDEX], result[F.ROLLOUT_INDEX])]
        for field in (F.AGENT_REF, F.ENVIRONMENT_SERVER, F.RUN_ID, F.SHARD, "task_id"):
            assert result[field] == plan[field]
        assert (
            result[F.ENVIRONMENT_SERVER]
            == {"math_agent": "math_env", "count_agent": "count_env"}[result[F.AGENT_REF]["name"]]
        )
        assert "reward" in result and "response" in result
    assert not rd.exists("rollouts-0_failures.jsonl")

    # Both worker processes took part.
    for log in workers.logs:
        assert "rollouts.collect" in log.read_text()

    entries = orjson.loads(rd.read_bytes("rollouts-0_aggregate_metrics.json"))
    assert [e[F.ENVIRONMENT_SERVER] for e in entries] == ["count_env", "math_env"]
    for entry in entries:
        env = servers.environments[entry[F.ENVIRONMENT_SERVER]]
        assert env.requests == 1
        assert len(env.last_rows) == sum(
            1 for r in planned if r[F.ENVIRONMENT_SERVER] == entry[F.ENVIRONMENT_SERVER]
        )
        assert all("responses_create_params" not in r for r in env.last_rows)
        assert all(set(r["response"]) <= {"usage", "incomplete_details"} for r in env.last_rows)
        answer = aggregate_metrics(env.last_rows)
        assert entry["agent_metrics"] == answer["agent_metrics"]
        assert entry["key_metrics"] == answer["key_metrics"]
        assert entry["group_level_metrics"] == answer["group_level_metrics"]
        assert (
            entry["agent_ref"]["name"]
            == {"math_env": "math_agent", "count_env": "count_agent"}[entry[F.ENVIRONMENT_SERVER]]
        )
    manifest = orjson.loads(rd.read_bytes("rollouts-0_manifest.json"))
    assert manifest["state"] == "completed"
    assert manifest["planned"] == 500
    status = orjson.loads(rd.read_bytes("rollouts-0_status.json"))
    assert status["landed"] == 500
    # The finish step wrote the run report beside the quality summary, on either store.
    report = rd.read_bytes("report.html")
    assert report.startswith(b"<!DOCTYPE html>") and b"500</b><span>landed" in report


def test_malformed_line_exits_2_naming_file_and_line(
    servers: RunningServers, config_file: str, tmp_path: Path
) -> None:
    rows = [orjson.dumps(r).decode() for r in demo_rows(5)]
    rows.insert(3, '{"responses_create_params": {"input": "x"}, "agent_ref": ')
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"

    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "run", "--config", config_file, "--input", str(data),
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert proc.returncode == 2, proc.stderr
    assert f"{data}:4" in proc.stderr
    assert "not valid JSON" in proc.stderr
    assert not out.exists()
    for agent in servers.agents:
        assert agent_stats(servers, agent)["requests"] == 0
    assert all(env.requests == 0 for env in servers.environments.values())
