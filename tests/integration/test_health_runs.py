"""Health and aggregation through real parts: Redis, worker processes, example servers, the CLI."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from examples.agent_server import AgentKnobs
from producer.shard.runner import RunOptions, execute_run
from schemas import fields as F
from tests.cluster import ExampleServers, StartWorkers
from tests.health_fixtures import crafted_folder
from tests.helpers import ROOT, demo_rows, read_jsonl, write_rows
from tests.runs import MakeRun
from workers.health import plan_recheck, run_local

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def summary(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((folder / "quality_summary.json").read_bytes())
    return data


def test_run_ends_with_health_summary_and_verdict_line(make_run: MakeRun) -> None:
    run = make_run(concurrency=32)
    out, workers = run.out, run.workers
    buffer = io.StringIO()
    settings = {"num_repeats": 2, "max_failed_fraction": 0.1}
    code = run.execute(demo_rows(20), settings, console=Console(file=buffer, width=200))
    assert code == 0
    run = summary(out)["run"]
    assert run["state"] == "complete"
    assert run["sources"] == ["rollouts-0.jsonl"]
    assert run["artifacts"]["records"] == 40
    assert {k: run["accounting"][k] for k in ("owed", "landed", "scored", "missing")} == {
        "owed": 40, "landed": 40, "scored": 40, "missing": 0,
    }  # fmt: skip
    assert run["healthy"] is True
    assert run["limits"]["max_failed_fraction"] == 0.1
    assert len(read_jsonl(out / "rollout_verdicts.jsonl")) == 40
    # The finish step's check rode on its counting pass (no second read of the results), and
    # its reports are what a standalone recheck writes.
    assert "reads the results again" not in workers.output()
    reports = [(out / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")]
    run_local(plan_recheck(str(out)))
    assert [(out / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")] == (
        reports
    )
    printed = buffer.getvalue()
    assert "Rollout health: 40 checked" in printed
    assert "Run health (complete): healthy" in printed
    # The verdict line comes after the metrics.
    assert printed.index("environment math_env") < printed.index("Run health")


def test_the_health_check_runs_while_the_environment_servers_aggregate(
    make_run: MakeRun,
) -> None:
    """The finish step checks the run's health while the servers are asked for their aggregate
    (it needs the rows, not their answer): with a server that takes 2 s to answer, the quality
    summary is written before the answer came, and the status and the aggregate file after;
    the reports are still a standalone recheck's (which reads the status written since)."""
    run = make_run(concurrency=16)
    out = run.out
    for env in run.servers.environments.values():
        env.aggregate_delay_ms = 2000
    code = run.execute(demo_rows(10), {"num_repeats": 2}, console=Console(file=io.StringIO()))
    assert code == 0
    answered = min(t for env in run.servers.environments.values() for t in env.answered_at)
    written = {n: os.stat(out / n).st_mtime for n in (
        "quality_summary.json", "rollouts-0_coverage.json", "rollouts-0_status.json",
        "rollouts-0_aggregate_metrics.json",
    )}  # fmt: skip
    assert written["rollouts-0_coverage.json"] <= written["quality_summary.json"] < answered
    assert answered <= written["rollouts-0_status.json"]
    assert answered <= written["rollouts-0_aggregate_metrics.json"]
    assert summary(out)["run"]["state"] == "complete"
    reports = [(out / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")]
    run_local(plan_recheck(str(out)))
    assert [(out / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")] == (
        reports
    )


FAILING = ("count_env",)


def test_failed_environment_keeps_its_entry_and_the_cli_exits_1(
    make_run: MakeRun, tmp_path: Path
) -> None:
    run = make_run(failing_environments=FAILING, concurrency=32)
    failing_servers, config, out = run.servers, run.config, run.out

    proc = cli(*run.args(demo_rows(10)))

    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "aggregation failed" in proc.stderr
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert [e[F.ENVIRONMENT_SERVER] for e in entries] == ["count_env", "math_env"]
    failed, ok = entries
    assert failed["agent_ref"] == {"name": "count_agent"}
    assert (failed["agent_metrics"], failed["key_metrics"], failed["group_level_metrics"]) == (
        {},
        {},
        [],
    )
    assert "500" in failed["aggregation_error"]
    assert "aggregation_error" not in ok and ok["key_metrics"]
    assert failing_servers.environments["count_env"].requests == 1
    # The health check still ran, and the run's verdict line was printed after the metrics.
    assert summary(out)["run"]["state"] == "complete"
    assert "Run health (complete)" in proc.stdout

    # `aggregate` over the same shard saves its file with the error and exits 1 too.
    proc = cli(
        "aggregate",
        "--input-glob",
        str(out / "rollouts-*.jsonl"),
        "--output",
        str(tmp_path / "m" / "all.jsonl"),
        "--config",
        config,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    entries = orjson.loads((tmp_path / "m" / "all_aggregate_metrics.json").read_bytes())
    assert [("aggregation_error" in e) for e in entries] == [True, False]


def test_aggregate_then_recheck_refuses_a_changed_shard(
    redis_url: str, start_workers: StartWorkers, config_file: str, tmp_path: Path
) -> None:
    start_workers(concurrency=32)
    for shard, rows in (("a", demo_rows(8)), ("b", demo_rows(6))):
        data = write_rows(tmp_path / f"{shard}.jsonl", rows)
        code = execute_run(
            RunOptions(config_path=config_file, input_path=data, output_dir=str(tmp_path / "runs" / shard), shard=shard, broker_url=redis_url),
            Console(file=io.StringIO()),
        )  # fmt: skip
        assert code == 0
    merged = tmp_path / "merged"

    proc = cli(
        "aggregate", "-i", f"{tmp_path}/runs/*/rollouts-*.jsonl", "-o", str(merged / "all.jsonl"),
        "--separate-datasets",  # shards a and b are two inputs, both numbered from task 0
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_jsonl(merged / "all.jsonl")
    assert len(rows) == 14
    assert [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in rows] == sorted(
        (r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in rows
    )
    assert "6 duplicate rollouts" in proc.stdout  # tasks 0-5 exist in both shards: reported, kept
    record = orjson.loads((merged / "all_merged_shards.json").read_bytes())
    assert [s["path"] for s in record["shards"]] == [
        "../runs/a/rollouts-a.jsonl",
        "../runs/b/rollouts-b.jsonl",
    ]
    assert [
        e[F.ENVIRONMENT_SERVER]
        for e in orjson.loads((merged / "all_aggregate_metrics.json").read_bytes())
    ] == ["count_env", "math_env"]
    assert summary(merged)["run"]["sources"] == [s["path"] for s in record["shards"]]
    assert summary(merged)["run"]["accounting"]["owed"] == 14

    proc = cli("health-check", str(merged))
    assert proc.returncode == 0, proc.stderr
    assert "Rollout health: 14 checked" in proc.stdout

    shard_file = tmp_path / "runs" / "b" / "rollouts-b.jsonl"
    changed = bytearray(shard_file.read_bytes())
    changed[len(changed) // 2] ^= 0x20
    shard_file.write_bytes(bytes(changed))
    proc = cli("health-check", str(merged))
    assert proc.returncode == 1
    assert "shard ../runs/b/rollouts-b.jsonl" in proc.stderr
    assert "not the file that was merged" in proc.stderr


def test_distributed_recheck_is_identical_to_local(
    redis_url: str, start_workers: StartWorkers, tmp_path: Path
) -> None:
    folder = crafted_folder(tmp_path)
    proc = cli("health-check", str(folder), "--limit", "max_failed_rollouts=1")
    assert proc.returncode == 0, proc.stderr
    local = [(folder / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")]
    for name in ("quality_summary.json", "rollout_verdicts.jsonl"):
        (folder / name).unlink()
    workers = start_workers(count=2, concurrency=2)

    env = {**os.environ, "ROLLOUTS_HEALTH_RANGE_BYTES": "300"}  # many jobs: lines straddle ranges
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "health-check", str(folder), "--limit", "max_failed_rollouts=1",
         "--distributed", "--broker", redis_url],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [
        (folder / n).read_bytes() for n in ("quality_summary.json", "rollout_verdicts.jsonl")
    ] == local
    logs = [log.read_text() for log in workers.logs]
    assert all("rollouts.health_scan" in text for text in logs), "both workers took jobs"
    assert any("rollouts.health_combine" in text for text in logs)
    assert not [p for p in folder.iterdir() if p.name.startswith(".health-scratch")]


def test_sigterm_writes_a_provisional_summary_within_5_seconds(make_run: MakeRun) -> None:
    slow = make_run(knobs=AgentKnobs(latency_ms=3000), workers=2, concurrency=32)
    out = slow.out
    try:
        args = slow.args(demo_rows(250), "--num-repeats", "4", "+max_failed_rollouts=5")
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        results = out / "rollouts-0.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if results.exists() and len(results.read_bytes().splitlines()) >= 100:
                break
            time.sleep(0.2)
        landed_before = len(results.read_bytes().splitlines())
        assert landed_before >= 100

        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        found = None
        while time.monotonic() - stopped < 5.0:
            path = out / "quality_summary.json"
            if path.exists():
                found = summary(out)
                break
            time.sleep(0.05)
        assert found is not None, "no summary within 5 seconds of SIGTERM"
        assert time.monotonic() - stopped < 5.0
        stdout, stderr = proc.communicate(timeout=60)
        # A partial result a resume can complete: 75, so a scheduler requeues the job.
        assert proc.returncode == 75, stdout + stderr
        assert "stopped by SIGTERM" in stderr
        stop = orjson.loads((out / "rollouts-0_coverage.json").read_bytes())
        assert stop["expected"] == 1000 and stop["successful"] >= landed_before
        assert stop["unknown"] == 1000 - stop["successful"] and not stop["complete"]

        # Let in-flight work settle, then compare with what is on storage.
        time.sleep(3)
        run = found["run"]
        keys = {(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in read_jsonl(results)}
        acc = run["accounting"]
        assert run["state"] == "provisional"
        assert acc["owed"] == 1000
        assert acc["landed"] == len(keys) >= landed_before
        assert acc["failed"] == {"total": 0, "by_class": {}}
        assert acc["missing"] == 1000 - len(keys)
        assert acc["scored"] is None and acc["duplicates"] is None
        assert run["verdicts"] == {"healthy": None, "unhealthy": None, "unobserved": None}
        assert run["accounting"]["run_excessive_failures"]["coverage"] == "evaluated"
        assert run["healthy"] is None
        assert run["reasons"][0].startswith("provisional")
        assert len(keys) < 1000, "the run was stopped before it finished"
        assert summary(out)["run"]["state"] == "provisional"  # the finish step kept it
    finally:
        slow.workers.stop()  # closes their connections first, so the slow agent has nothing in flight
        slow.servers.stop()


def test_aggregation_error_is_saved_then_reraised_for_callers_that_ask(
    example_servers: ExampleServers, tmp_path: Path
) -> None:
    import httpx

    from infra.store import RunDir
    from schemas.config import ServersConfig
    from workers.finish import write_aggregate_file

    failing_servers = example_servers(failing_environments=FAILING)
    config = ServersConfig.model_validate(failing_servers.config())
    rows = [
        {F.TASK_INDEX: t, F.ROLLOUT_INDEX: 0, "reward": 1.0, F.AGENT_REF: {"name": agent},
         F.ENVIRONMENT_SERVER: env, "response": {"output": [], "usage": {"input_tokens": 1}}}
        for t, (agent, env) in enumerate([("math_agent", "math_env"), ("count_agent", "count_env"), ("x", "nowhere")])
    ]  # fmt: skip
    rd = RunDir(str(tmp_path))
    with pytest.raises(httpx.HTTPStatusError):
        write_aggregate_file(rd, "agg.json", rows, config, raise_on_error=True)
    entries = orjson.loads((tmp_path / "agg.json").read_bytes())
    assert [e[F.ENVIRONMENT_SERVER] for e in entries] == ["count_env", "math_env", "nowhere"]
    assert "500" in entries[0]["aggregation_error"]
    assert "aggregation_error" not in entries[1]
    assert "not in the config" in entries[2]["aggregation_error"]
    # What the server received: stripped rows, the response cut to its usage.
    assert failing_servers.environments["math_env"].last_rows == [
        {F.TASK_INDEX: 0, F.ROLLOUT_INDEX: 0, "reward": 1.0, F.AGENT_REF: {"name": "math_agent"},
         F.ENVIRONMENT_SERVER: "math_env", "response": {"usage": {"input_tokens": 1}}}
    ]  # fmt: skip
    assert write_aggregate_file(rd, "agg2.json", rows[:1], config) is None
