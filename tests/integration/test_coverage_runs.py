"""Coverage, strict completion and exit 75 with real workers, Redis and the example servers.

A run stopped by SIGTERM exits 75 and leaves coverage that a resume completes to exit 0 (the
dispatch-budget drain and `cancel --drain` are in `test_budget_resume.py` and `test_cancel.py`);
a strict run rejected with nothing left to run publishes no metric values and exits 1; rollouts
settled as scored zeros complete a strict run; `resume --plan` dispatches nothing and accounts
for every expected rollout, on a local folder, on S3 and in a merged folder; the Python API's
omissions and unrouted failures.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.agent_server import AgentKnobs
from examples.servers import free_port
from infra.store import RunDir
from producer import preprocess_examples
from producer.api.calls import RUN_ERROR
from schemas import fields as F
from schemas.errors import RolloutFailedError
from schemas.settings import CollectionSettings
from tests.api_helpers import first_then_close
from tests.cluster import StartWorkers
from tests.helpers import demo_rows, read_jsonl, write_rows
from tests.ops_helpers import (
    cli,
    landed_lines,
    manifest,
    request_log,
    rows_by_key,
    run_split,
    wait_for,
)
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def coverage_of(run_dir: Path | str, shard: str = "0") -> dict[str, Any]:
    rd = RunDir(str(run_dir))
    data: dict[str, Any] = orjson.loads(rd.read_bytes(f"rollouts-{shard}_coverage.json"))
    return data


def summary_of(run_dir: Path) -> dict[str, Any]:
    """The `run` object of the folder's health summary."""
    run: dict[str, Any] = orjson.loads((run_dir / "quality_summary.json").read_bytes())["run"]
    return run


def assert_invariants(c: dict[str, Any]) -> None:
    assert c["successful"] == c["measured"] + c["masked"] + c["unscored"]
    assert c["expected"] == (
        c["successful"] + c["failed"] + c["intentionally_omitted"] + c["unknown"]
    )
    assert sum(c["states"].values()) == c["expected"]


@pytest.mark.timeout(240)
def test_sigterm_exits_75_and_a_resume_completes_the_run_to_0(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run(knobs=AgentKnobs(latency_ms=300), workers=2)
    out = run.out
    try:
        producer = run.start(demo_rows(120))
        results = out / "rollouts-0.jsonl"
        wait_for(lambda: landed_lines(out) >= 20, 60, "20")
        producer.send_signal(signal.SIGTERM)
        assert producer.wait(60) == 75, run.log()
        assert "stopped by SIGTERM" in run.log()
        stopped = coverage_of(out)
        assert_invariants(stopped)
        assert stopped["unknown"] > 0 and not stopped["complete"]
        # The provisional health summary points at that coverage record; it judges no
        # completeness itself.
        pointer = summary_of(out)["coverage"]
        assert pointer["complete"] is False and pointer["unknown"] == stopped["unknown"]
        assert pointer["files"][0]["path"] == "rollouts-0_coverage.json"
        assert pointer["files"][0]["written_by"] == "stop"
        # The workers drain the stopped generation; then the folder's account is exact.
        wait_for(lambda: manifest(out)["state"] != "running", 60, "the stopped run's finish")
        plan = cli("resume", str(out), "--plan", "--json")
        assert plan.returncode == 0, plan.stderr
        planned = orjson.loads(plan.stdout)
        assert planned["coverage"]["states"]["missing"] == planned["coverage"]["unknown"] > 0
        generations = len(manifest(out)["generations"])
        assert generations == 1  # --plan dispatched nothing and opened no generation
        proc = cli("resume", str(out), "--broker", redis_url)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        run.servers.stop()
    done = coverage_of(out)
    assert_invariants(done)
    assert done["complete"] and done["measured"] == 120 and done["unknown"] == 0
    pointer = summary_of(out)["coverage"]
    assert pointer["complete"] is True and pointer["files"][0]["written_by"] == "finish"
    assert len(rows_by_key(results)) == 120
    assert [g["kind"] for g in manifest(out)["generations"]] == ["run", "resume"]


def test_a_rejected_strict_run_publishes_no_metric_values_and_exits_1(make_run: MakeRun) -> None:
    run = make_run()
    servers, out = run.servers, run.out
    rows = demo_rows(10)
    for i in (2, 5):  # terminal: nothing a resume could run
        rows[i]["result_extra"] = {"_ng_failure_class": "reference_missing",
                                   "_ng_failure_terminal": True}  # fmt: skip
    proc = run.cli(rows, "+route_failures_to_sidecar=true", "+require_complete=true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "EVAL FAILED: 8/10 samples completed" in proc.stderr
    assert "no rollout is left that can run" in proc.stderr
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert entries
    for entry in entries:
        assert entry["complete"] is False and entry["completion_rejected"].startswith("EVAL")
        assert entry["agent_metrics"] == {} and entry["key_metrics"] == {}
        assert entry["group_level_metrics"] == [] and entry["repeat_level_metrics"] == []
    assert sum(env.requests for env in servers.environments.values()) == 0  # nobody asked
    c = coverage_of(out)
    assert_invariants(c)
    assert (c["states"]["terminal"], c["failed"], c["complete"]) == (2, 2, False)
    # Completeness is the coverage's to say, not the health verdict's: the summary points at it,
    # and the two terminal failures are no health reason (no failure limit is set).
    summary = summary_of(out)
    assert summary["coverage"]["complete"] is False and summary["coverage"]["failed"] == 2
    assert summary["healthy"] is None and not any("complete" in r for r in summary["reasons"])
    assert manifest(out)["state"] == "failed"
    status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    assert {m["aggregation_status"] for m in status["members"].values()} == {"deferred"}


def test_scored_zeros_complete_a_strict_run(make_run: MakeRun) -> None:
    run = make_run()
    out = run.out
    rows = demo_rows(10)
    for i in (1, 4):
        rows[i]["result_extra"] = {"_ng_failure_class": "judge_failed"}
    proc = run.cli(
        rows, "+route_failures_to_sidecar=true", "+require_complete=true",
        "+count_failure_classes_as_zero=[judge_failed]",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    c = coverage_of(out)
    assert_invariants(c)
    assert c["complete"] and (c["counted_failures"], c["states"]["model_final"]) == (2, 2)
    assert (c["successful"], c["scored"]) == (8, 10)
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert all("completion_rejected" not in e and e["key_metrics"] for e in entries)
    assert {e["coverage"]["coverage/counted_failures"] for e in entries} == {2}
    status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    assert status["schema_version"] == "1" and status["updated_at"].endswith("Z")
    members = status["members"]
    assert sum(m["expected_rollout_count"] for m in members.values()) == 10
    assert sum(m["completed_rollout_count"] for m in members.values()) == 10
    assert {m["aggregation_status"] for m in members.values()} == {"complete"}
    report = orjson.loads(cli("status", str(out), "--json").stdout)
    assert report["coverage"]["counted_failures"] == 2 and report["exit_code"] == 0
    page = (out / "report.html").read_text()
    run_id = manifest(out)["run_id"]
    assert f"Run report: {run_id} shard 0" in page and 'id="coverage"' in page


def test_resume_plan_accounts_for_every_rollout_on_any_store_and_runs_nothing(
    make_run: MakeRun, redis_url: str, run_dir_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    run = make_run(knobs=AgentKnobs(request_log=str(log)))
    try:
        rows = demo_rows(8)
        rows[0]["fault"] = {"kind": "http500", "times": 9}  # one failed attempt: the limit is 1
        rows[1]["result_extra"] = {"_ng_failure_class": "x", "_ng_failure_terminal": True}
        proc = cli(
            "run", "--config", run.config, "--input", run.input(rows), "--output-dir", run_dir_url,
            "--broker", redis_url, "+route_failures_to_sidecar=true", "+max_attempts=1",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        before = len(request_log(log))
        plan = cli("resume", run_dir_url, "--plan", "--json")
        extended = cli("resume", run_dir_url, "--plan", "--json", "--extend-retries", "2")
        text = cli("resume", run_dir_url, "--plan")
        after = len(request_log(log))
    finally:
        run.servers.stop()
    assert plan.returncode == 0, plan.stderr
    body = orjson.loads(plan.stdout)
    assert body["rollouts"]["exhausted"] == [[0, 0]] and body["rollouts"]["terminal"] == [[1, 0]]
    assert len(body["rollouts"]["scored"]) == 6
    assert body["coverage"]["states"] == {
        "scored": 6, "model_final": 0, "judge_recoverable": 0, "retryable": 0, "exhausted": 1,
        "terminal": 1, "missing": 0, "masked": 0, "omitted": 0,
    }  # fmt: skip
    assert body["coverage"]["identity_verified"] is True
    again = orjson.loads(extended.stdout)
    assert again["rollouts"]["retryable"] == [[0, 0]] and again["rollouts"]["exhausted"] == []
    assert again["coverage"]["max_rollout_attempts"] == 3
    assert "8 planned: 6 scored, 1 exhausted, 1 terminal" in text.stdout, text.stdout
    assert after == before  # nothing was dispatched
    assert [g.kind for g in _generations(run_dir_url)] == ["run"]
    assert coverage_of(run_dir_url)["written_by"] == "plan"


def _generations(run_dir: str) -> list[Any]:
    from infra.runs import read_manifest

    return read_manifest(RunDir(run_dir), "0").generations


def test_resume_plan_on_a_merged_folder_plans_each_shard(
    redis_url: str, start_workers: StartWorkers, config_file: str, tmp_path: Path
) -> None:
    start_workers(concurrency=16)
    run_split(config_file, write_rows(tmp_path / "rows.jsonl", demo_rows(8)), tmp_path, redis_url)
    merged = tmp_path / "merged"
    proc = cli(
        "aggregate", "-i", f"{tmp_path}/split/*/rollouts-*.jsonl", "-o", str(merged / "all.jsonl")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = cli("resume", str(merged), "--plan", "--json")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    shards = orjson.loads(plan.stdout)["shards"]
    assert [s["shard"] for s in shards] == ["0", "1"]
    assert [s["coverage"]["measured"] for s in shards] == [4, 4]
    for index in (0, 1):
        assert coverage_of(tmp_path / "split" / str(index), str(index))["complete"]


def test_the_python_api_records_omissions_and_hands_back_unrouted_failures(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run({"math_agent": "math_env"}, AgentKnobs(latency_ms=60_000))
    servers, out = run.servers, run.out
    try:
        raw = [{**r, "agent_ref": {"name": "math_agent"}} for r in demo_rows(6)]
        rows = preprocess_examples(raw, servers.config(), CollectionSettings())
        for row in rows[:2]:
            row["agent_latency_ms"] = 0
        rows[2]["agent_latency_ms"] = 0
        rows[2]["fault"] = {"kind": "http500", "times": 9}

        got, finished = first_then_close(
            rows, servers.config(), 3, broker_url=redis_url, record_output_dir=str(out),
            record_unrouted_failures=True, record_omitted_rollouts=True,
            settings={"require_complete": True},
        )  # fmt: skip
    finally:
        servers.stop()
    failed = [result for _, result in got if F.FAILURE_CLASS in result]
    assert len(failed) == 1 and isinstance(failed[0][RUN_ERROR], RolloutFailedError)
    assert failed[0][F.FAILURE_RECORD]["schema_version"] == 1
    sidecar = read_jsonl(out / "rollouts-0_failures.jsonl")
    omitted = [r for r in sidecar if r.get(F.OMITTED)]
    assert len(omitted) == 3 and {r[F.FAILURE_CLASS] for r in omitted} == {"omitted"}
    c = coverage_of(out)
    assert_invariants(c)
    assert (c["successful"], c["failed"], c["intentionally_omitted"]) == (2, 1, 3)
    assert c["states"]["omitted"] == 3 and c["unknown"] == 0
    # Strict: the failure is not complete; the omissions are (5 of 6 completed).
    assert finished is not None and "EVAL FAILED: 5/6" in str(finished.rejection)


def test_requests_never_sent_spend_no_attempt(make_run: MakeRun, redis_url: str) -> None:
    """An agent that is not listening (connection refused: the request never left) fails every
    rollout with a `not_sent` failure record; with an attempt limit of 1 they stay `retryable`,
    where a delivered failure would have exhausted them, and a resume runs them all."""
    run = make_run()
    try:
        config = run.servers.config()
        for agent in config["agents"].values():
            agent["url"] = f"http://127.0.0.1:{free_port()}"
        run.write_config(config)
        # The refused connects are retried as always (`connect_retries`), after short waits.
        proc = run.cli(
            demo_rows(4), "+route_failures_to_sidecar=true", "+max_attempts=1",
            "+retry_backoff_s=0.02",
        )  # fmt: skip
        plan = cli("resume", str(run.out), "--plan", "--json")
    finally:
        run.servers.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr  # failures routed: the run ends 0
    failures = read_jsonl(run.out / "rollouts-0_failures.jsonl")
    assert failures and all(row[F.FAILURE_RECORD]["delivery"] == "not_sent" for row in failures), (
        failures[0]
    )
    assert plan.returncode == 0, plan.stderr
    body = orjson.loads(plan.stdout)
    assert body["coverage"]["states"]["exhausted"] == 0
    assert body["coverage"]["states"]["retryable"] == 4
