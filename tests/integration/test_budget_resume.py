"""The dispatch budget, and resume (ours and NeMo Gym's spelling) over real workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.agent_server import AgentKnobs
from examples.tasks import make_row
from schemas import fields as F
from tests.helpers import demo_rows, read_jsonl
from tests.ops_helpers import cli, manifest, request_log, requests_per_key, rows_by_key
from tests.runs import MakeRun, Run

pytestmark = pytest.mark.integration


def logged(
    make_run: MakeRun, topology: dict[str, str] | None = None, **knobs: Any
) -> tuple[Run, Path]:
    """A run of one worker whose agents log every request: the run and the agents' log."""
    log = make_run.folder / "requests.jsonl"
    return make_run(topology, AgentKnobs(**knobs, request_log=str(log))), log


def test_rows_not_started_within_the_budget_are_drained_and_resume_runs_exactly_them(
    make_run: MakeRun, redis_url: str
) -> None:
    run, log = logged(make_run, {"math_agent": "math_env"}, latency_ms=1000)
    out = run.out
    rows = [make_row("arithmetic", i, "math_agent") for i in range(30)]
    proc = run.cli(rows, "--max-resident-tasks", "3", "+dispatch_budget_s=2.5")
    # A partial result a resume can complete: exit 75, so a scheduler requeues it.
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "drained by its dispatch budget" in proc.stderr
    m = manifest(out)
    planned = {
        (r[F.TASK_INDEX], r[F.ROLLOUT_INDEX])
        for r in read_jsonl(out / "rollouts-0_materialized_inputs.jsonl")
    }
    landed = set(rows_by_key(out / "rollouts-0.jsonl"))
    drained = planned - landed
    assert 3 <= len(landed) <= 15 and drained
    assert not (out / "rollouts-0_failures.jsonl").exists()
    first_requests = requests_per_key(log)
    assert set(first_requests) == landed  # drained rows never reached the agent
    status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    assert status["drained"] == len(drained)
    coverage = orjson.loads((out / "rollouts-0_coverage.json").read_bytes())
    assert (coverage["expected"], coverage["successful"]) == (30, len(landed))
    assert coverage["unknown"] == coverage["states"]["missing"] == len(drained)
    assert coverage["complete"] is False and coverage["written_by"] == "finish"
    # What a drained row holds is the engine's (tests/unit/test_rollout_engine.py); the
    # chord only counts its tasks, so nothing of them is stored in the result backend.
    proc = cli("resume", str(out), "--broker", redis_url, "+dispatch_budget_s=null")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"running {len(drained)}" in proc.stdout
    run.servers.stop()
    resumed = requests_per_key(log) - first_requests
    assert set(resumed) == drained and set(resumed.values()) == {1}
    assert set(rows_by_key(out / "rollouts-0.jsonl")) == planned
    m = manifest(out)
    assert [g["kind"] for g in m["generations"]] == ["run", "resume"]
    assert m["generations"][1]["enqueued"] == len(drained)
    assert m["generations"][1]["overrides"] == {"dispatch_budget_s": None}
    assert m["state"] == "completed"
    coverage = orjson.loads((out / "rollouts-0_coverage.json").read_bytes())
    assert coverage["complete"] is True and coverage["unknown"] == 0
    assert coverage["measured"] == 30 and coverage["generation"] == 1


def test_nemo_gym_resume_counts_attempts_and_never_retries_terminal_failures(
    make_run: MakeRun, redis_url: str
) -> None:
    run, log = logged(make_run)
    servers, out = run.servers, run.out
    rows = demo_rows(10)
    rows[0]["fault"] = {"kind": "http500", "times": 1}  # fails once, then works
    rows[1]["fault"] = {"kind": "http500", "times": 9}  # fails every time
    rows[2]["result_extra"] = {
        "_ng_failure_class": "judge_failed",
        "_ng_failure_terminal": True,
    }
    rows[3]["fault"] = {"kind": "http502", "times": 9}  # replayed to the limit within the run
    proc = run.cli(rows, "+route_failures_to_sidecar=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = len(request_log(log))
    landed_before = set(rows_by_key(out / "rollouts-0.jsonl"))
    assert landed_before == {(i, 0) for i in range(4, 10)}

    # NeMo Gym's spelling, without --config (the run's own config snapshot is used).
    proc = cli(
        "run", f"+input_jsonl_fpath={out}/rollouts-0_materialized_inputs.jsonl",
        f"+output_jsonl_fpath={out}/rollouts-0.jsonl", "+resume_from_cache=true",
        "+num_repeats=1", "--broker", redis_url,
        env={"NEMO_GYM_MAX_ROLLOUT_ATTEMPTS": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "10 planned: 6 scored, 2 retryable, 1 exhausted, 1 terminal (attempt limit 2); "
        "running 2 (retryable and missing)" in proc.stdout
    )
    aggregated = {name: len(env.last_rows) for name, env in servers.environments.items()}
    servers.stop()
    resumed = [e for e in request_log(log)[first:] if e["event"] == "start"]
    assert sorted((e["task"], e["attempt"]) for e in resumed) == [(0, 1), (1, 1)]
    results = rows_by_key(out / "rollouts-0.jsonl")
    assert set(results) == landed_before | {(0, 0)}
    assert results[(0, 0)][0][F.ATTEMPT_INDEX] == 1
    assert F.rollout_id(results[(0, 0)][0]) == "0-0-a1"
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert [r.get(F.ATTEMPT_INDEX, 0) for r in failures[(1, 0)]] == [0, 1]
    assert len(failures[(2, 0)]) == 1 and len(failures[(3, 0)]) == 3
    m = manifest(out)
    assert [g["kind"] for g in m["generations"]] == ["run", "resume"]
    assert m["generations"][0]["token"] != m["generations"][1]["token"]
    assert m["generations"][1]["overrides"] == {"max_attempts": 2}
    assert m["state"] == "completed"
    # The finish step aggregated old and new results together.
    assert sum(aggregated.values()) == len(results) == 7


def test_resume_and_status_on_any_store(
    make_run: MakeRun, redis_url: str, run_dir_url: str
) -> None:
    from infra.runs import read_manifest
    from infra.store import RunDir

    run = make_run()
    servers = run.servers
    rows = demo_rows(6)
    rows[0]["fault"] = {"kind": "http500", "times": 1}
    proc = cli(
        "run", "--config", run.config, "--input", run.input(rows), "--output-dir", run_dir_url,
        "--broker", redis_url, "+route_failures_to_sidecar=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = cli(
        "run", f"+output_jsonl_fpath={run_dir_url}/rollouts-0.jsonl",
        "+resume_from_cache=true", "--broker", redis_url,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = cli("status", run_dir_url, "--json", "--redis", redis_url)
    # Nothing to run and the files as the last finish read them: its result stands.
    aggregated = sum(env.requests for env in servers.environments.values())
    again = cli("resume", run_dir_url, "--broker", redis_url)
    assert again.returncode == 0, again.stdout + again.stderr
    assert sum(env.requests for env in servers.environments.values()) == aggregated
    servers.stop()
    assert "running 0" in again.stdout and "its aggregate metrics" in again.stdout, again.stdout
    assert "landed 6/6 rollouts; state completed" in again.stdout
    rd = RunDir(run_dir_url)
    results = [orjson.loads(line) for _, line in rd.iter_lines("rollouts-0.jsonl")]
    failures = [orjson.loads(line) for _, line in rd.iter_lines("rollouts-0_failures.jsonl")]
    assert sorted(str(F.rollout_id(r)) for r in results) == [
        "0-0-a1",
        "1-0",
        "2-0",
        "3-0",
        "4-0",
        "5-0",
    ]
    assert [F.rollout_id(r) for r in failures] == ["0-0"]
    assert [g.kind for g in read_manifest(rd, "0").generations] == ["run", "resume"]
    assert status.returncode == 0, status.stderr
    report = orjson.loads(status.stdout)
    assert (report["planned"], report["landed"], report["failed"], report["failure_rows"]) == (
        6, 6, {}, 1,
    )  # fmt: skip


def test_a_resume_with_nothing_to_run_keeps_the_last_finish_while_its_inputs_stand(
    make_run: MakeRun, redis_url: str
) -> None:
    run, log = logged(make_run)
    servers, out = run.servers, run.out

    def aggregations() -> int:
        return sum(env.requests for env in servers.environments.values())

    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in out.iterdir()}

    proc = run.cli(demo_rows(4))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert manifest(out)["finished"]["result"]["landed"] == 4
    before, finished_once = files(), aggregations()
    assert finished_once >= 1

    proc = cli("resume", str(out), "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "running 0" in proc.stdout and "last finish" in proc.stdout, proc.stdout
    assert "landed 4/4 rollouts; state completed" in proc.stdout
    assert files() == before and aggregations() == finished_once  # nothing read or written

    # A changed setting can change the finish: it runs again, in a new generation.
    proc = cli("resume", str(out), "--broker", redis_url, "+max_failed_fraction=0.5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "last finish" not in proc.stdout
    assert aggregations() > finished_once
    m = manifest(out)
    assert [g["kind"] for g in m["generations"]] == ["run", "resume"]
    assert m["finished"]["token"] == m["generations"][-1]["token"]

    # Files that are not what the finish read (the results lost): the plan reads them.
    (out / "rollouts-0.jsonl").unlink()
    started = len(requests_per_key(log))
    proc = cli("resume", str(out), "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "running 4" in proc.stdout, proc.stdout
    servers.stop()
    assert started == 4 and sum(requests_per_key(log).values()) == 8
    assert len(rows_by_key(out / "rollouts-0.jsonl")) == 4
