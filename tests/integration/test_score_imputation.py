"""Score imputation through `rollouts run` and `rollouts resume` over real workers and servers."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from examples.agent_server import AgentKnobs
from tests.helpers import math_rows, read_jsonl
from tests.ops_helpers import cli, requests_per_key, rows_by_key
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def test_failures_and_missing_rollouts_scored_as_zero_are_reported_and_not_run_again(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    run = make_run({"math_agent": "math_env"}, AgentKnobs(request_log=str(log)))
    servers, out = run.servers, run.out
    rows = math_rows(6)
    rows[0]["result_extra"] = {"_ng_failure_class": "judge_failed"}  # scored as zero
    rows[1]["fault"] = {"kind": "http500", "times": 9}  # agent_run_error: left out
    rows[2]["result_extra"] = {"_ng_no_persist": True}  # leaves no row: imputed
    proc = run.cli(
        rows, "+route_failures_to_sidecar=true",
        "+count_failure_classes_as_zero=[judge_failed]", "+count_missing_rollouts_as_zero=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failures = str(out / "rollouts-0_failures.jsonl")
    assert (
        "Rollouts missing from the score: 1 of 6 materialized "
        f"(1 agent_run_error routed this run; see {failures})"
    ) in proc.stdout
    assert "Metrics cover: 5 of 6 rollouts" in proc.stdout
    assert "Scored as zero because they left no row: 1 of 6 rollouts" in proc.stdout
    landed = rows_by_key(out / "rollouts-0.jsonl")
    assert set(landed) == {(3, 0), (4, 0), (5, 0)}  # the metrics' zeros are in no file
    scored = {r["_ng_task_index"]: r for r in servers.environments["math_env"].last_rows}
    assert sorted(scored) == [0, 2, 3, 4, 5]
    assert scored[0]["reward"] == 0.0 and scored[2]["reward"] == 0.0
    assert scored[2]["difficulty"] == rows[2]["difficulty"]  # the task's dataset field
    rewards = [r[0]["reward"] for r in landed.values()]
    aggregate = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert aggregate[0]["agent_metrics"]["mean/reward"] == pytest.approx(sum(rewards) / 5)
    first = requests_per_key(log)

    proc = cli("resume", str(out), "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 planned: 3 scored, 1 model_final, 1 retryable, 1 missing" in proc.stdout
    assert "running 2 (retryable and missing)" in proc.stdout
    assert "Metrics cover: 5 of 6 rollouts" in proc.stdout
    servers.stop()
    resumed = requests_per_key(log) - first
    assert set(resumed) == {(1, 0), (2, 0)}  # the judge_failed rollout is settled
    assert [r["_ng_task_index"] for r in read_jsonl(failures)].count(0) == 1
