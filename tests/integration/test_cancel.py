"""`rollouts cancel [--drain]` against a running shard, then a resume that runs the rest."""

from __future__ import annotations

import orjson
import pytest

from examples.agent_server import AgentKnobs
from tests.helpers import agent_stats, math_rows
from tests.ops_helpers import cli, manifest, rows_by_key, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("drain", [False, True], ids=["cancel", "drain"])
def test_cancel_stops_the_run_and_resume_finishes_it(
    drain: bool, make_run: MakeRun, redis_url: str
) -> None:
    run = make_run({"math_agent": "math_env"}, AgentKnobs(latency_ms=5000), concurrency=32)
    servers, out = run.servers, run.out
    producer = run.start(math_rows(30), "--max-resident-tasks", "4")
    wait_for(lambda: agent_stats(servers, "math_agent")["in_flight"] == 4, 30, "4 calls in flight")
    # (Each call takes 5 s: the cancel below lands while all four are still running.)
    # No --redis: the Redis is found where the run recorded it.
    proc = cli("cancel", str(out), *(["--drain"] if drain else []))
    assert proc.returncode == 0, proc.stderr
    assert ("draining" if drain else "cancelling") in proc.stdout
    # A drain saved a partial result a resume completes: 75 (requeue); a cancel ends it: 1.
    assert producer.wait(60) == (75 if drain else 1)
    text = run.log()
    assert ("drained by `rollouts cancel --drain`" if drain else "the run was cancelled") in text
    stats = agent_stats(servers, "math_agent")
    m = manifest(out)
    status = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    landed = set(rows_by_key(out / "rollouts-0.jsonl"))
    report = orjson.loads(cli("status", str(out), "--json").stdout)
    coverage = orjson.loads((out / "rollouts-0_coverage.json").read_bytes())
    assert cli("cancel", str(out)).stdout.startswith("nothing to cancel")
    proc = cli("resume", str(out), "--broker", redis_url, "+max_resident_tasks=null")
    assert proc.returncode == 0, proc.stdout + proc.stderr
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
