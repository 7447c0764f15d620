"""`rollouts cancel [--drain]` against a running shard, then a resume that runs the rest."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from examples.agent_server import AgentKnobs
from examples.servers import start_servers
from examples.tasks import make_row
from tests.conftest import Workers, write_rows
from tests.ops_helpers import cli, cli_background, manifest, rows_by_key, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("drain", [False, True], ids=["cancel", "drain"])
def test_cancel_stops_the_run_and_resume_finishes_it(
    drain: bool, redis_url: str, workers: Workers, tmp_path: Path
) -> None:
    servers = start_servers({"math_agent": "math_env"}, AgentKnobs(latency_ms=5000))
    agent = servers.urls["math_agent"]
    try:
        workers.start(count=1, concurrency=32)
        workers.wait_ready()
        out = tmp_path / "run"
        run = cli_background(
            "run", "--config", servers.write_config(str(tmp_path / "servers.yaml")),
            "--input", write_rows(tmp_path / "rows.jsonl", [make_row("arithmetic", i, "math_agent") for i in range(30)]),
            "--output-dir", str(out), "--broker", redis_url, "--max-resident-tasks", "4",
            log=tmp_path / "run.log",
        )  # fmt: skip
        wait_for(
            lambda: httpx.get(agent + "/stats").json()["in_flight"] == 4, 30, "4 calls in flight"
        )
        # (Each call takes 5 s: the cancel below lands while all four are still running.)
        # No --redis: the Redis is found where the run recorded it.
        proc = cli("cancel", str(out), *(["--drain"] if drain else []))
        assert proc.returncode == 0, proc.stderr
        assert ("draining" if drain else "cancelling") in proc.stdout
        # A drain saved a partial result a resume completes: 75 (requeue); a cancel ends it: 1.
        assert run.wait(60) == (75 if drain else 1)
        text = (tmp_path / "run.log").read_text()
        assert (
            "drained by `rollouts cancel --drain`" if drain else "the run was cancelled"
        ) in text
        stats = httpx.get(agent + "/stats").json()
        m = manifest(out)
        status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
        landed = set(rows_by_key(out / "rollouts-0.jsonl"))
        report = orjson.loads(cli("status", str(out), "--json").stdout)
        coverage = orjson.loads((out / "rollouts-0_coverage.json").read_bytes())
        assert cli("cancel", str(out)).stdout.startswith("nothing to cancel")
        proc = cli("resume", str(out), "--broker", redis_url, "+max_resident_tasks=null")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        servers.stop()
    assert stats["requests"] == 4  # nothing started after the cancel
    assert m["state"] == "cancelled"
    assert status["drained"] == 0  # the budget drained nothing: the cancel stopped them
    assert report["stopped"] == 26 and report["in_flight"] == 0
    if drain:
        assert stats["cancelled"] == 0 and len(landed) == 4
        assert m["error"] == "cancelled with --drain"
    else:
        assert stats["cancelled"] == 4 and not landed, (stats, status, landed)
        assert status["cancelled"] == 4
    assert coverage["unknown"] == 30 - len(landed) and coverage["successful"] == len(landed)
    assert coverage["states"]["missing"] == 30 - len(landed) and not coverage["complete"]
    assert report["coverage"]["unknown"] == coverage["unknown"] and report["exit_code"] == (
        75 if drain else 1
    )
    assert len(rows_by_key(out / "rollouts-0.jsonl")) == 30
    assert manifest(out)["state"] == "completed"
    assert orjson.loads((out / "rollouts-0_coverage.json").read_bytes())["complete"] is True
