"""Cluster-wide caps measured by the agent server itself, and slots coming back after a SIGKILL."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.tasks import make_row
from infra import keys
from infra.slots import slot_holder
from infra.store import RunDir
from tests.helpers import Sampler, agent_stats
from tests.ops_helpers import manifest, rows_by_key, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def in_flight(url: str) -> Sampler[int]:
    """The agent at `url`'s in-flight count, sampled every 20 ms."""
    return Sampler(lambda: int(httpx.get(url + "/stats").json()["in_flight"]))


def test_max_resident_tasks_caps_the_cluster_and_recovers_after_a_worker_dies(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(
        {"math_agent": "math_env"}, AgentKnobs(latency_ms=300),
        workers=3, concurrency=16, env={"ROLLOUTS_LEASE_TTL_S": "3"},
    )  # fmt: skip
    sampler = in_flight(run.servers.urls["math_agent"])
    out = run.out
    try:
        rows = [make_row("arithmetic", i, "math_agent") for i in range(160)]
        producer = run.start(
            rows, "--max-resident-tasks", "5", "+route_failures_to_sidecar=true",
            "+stall_timeout_s=8",
        )  # fmt: skip
        wait_for(
            lambda: (
                (out / "rollouts-0.jsonl").exists()
                and len(rows_by_key(out / "rollouts-0.jsonl")) >= 20
            ),
            60,
            "20 results",
        )
        # Kill a worker that holds slots right now: its leases stay behind until they expire.
        sid = keys.shard_id(RunDir(str(out)).url, "0")
        held: list[bytes] = r.zrange(keys.shard_leases(sid), 0, -1)  # type: ignore[assignment]
        holders = [slot_holder(m.decode()).rsplit(":", 1)[1] for m in held]
        victim = next(p for p in run.workers.procs if str(p.pid) in holders)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait(10)
        held = r.zrange(keys.shard_leases(sid), 0, -1)  # type: ignore[assignment]
        dead = [m for m in held if f":{victim.pid}:" in m.decode()]
        assert dead, "the killed worker held no slot"
        # Its leases expire (3 s here) and the slots go back into use.
        wait_for(
            lambda: not any(r.zscore(keys.shard_leases(sid), m) for m in dead),
            20,
            "dead leases to go",
        )
        code = producer.wait(240)
        log = run.log()
        # The killed worker's rollouts (running or waiting for a slot) are taken over by the
        # live workers once their rollout leases expire: the run finishes by itself.
        assert code == 0, log
        assert "the run stalled" not in log
    finally:
        sampler.stop()
        stats = agent_stats(run.servers, "math_agent")
        run.servers.stop()
    assert stats["max_in_flight"] <= 5
    assert stats["max_in_flight"] == 5
    after = [n for t, n in sampler.samples if t > killed_at]
    dip = next(i for i, n in enumerate(after) if n < 5)
    assert 5 in after[dip:], "the dead worker's slots never came back"
    assert len(rows_by_key(out / "rollouts-0.jsonl")) == 160
    assert manifest(out)["state"] == "completed"


def test_agent_max_concurrency_caps_calls_to_that_agent(make_run: MakeRun) -> None:
    run = make_run({"math_agent": "math_env"}, AgentKnobs(latency_ms=200), workers=2)
    config = run.servers.config()
    config["agents"]["math_agent"]["max_concurrency"] = 3
    run.write_config(config)
    rows = [make_row("arithmetic", i, "math_agent") for i in range(40)]
    proc = run.cli(rows)
    stats = agent_stats(run.servers, "math_agent")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert stats["max_in_flight"] == 3
    assert stats["completed"] == 40


def test_rollouts_waiting_in_line_stay_listed_as_waiting_past_a_lease_ttl(
    make_run: MakeRun, r: redis.Redis
) -> None:
    """Only the first of a worker's waiting rollouts polls (`WaitingLines`); the others still
    ask within a lease TTL, so `rollouts status` and the stall check keep seeing them wait."""
    run = make_run(
        {"math_agent": "math_env"}, AgentKnobs(latency_ms=2500), env={"ROLLOUTS_LEASE_TTL_S": "3"}
    )
    rows = [make_row("arithmetic", i, "math_agent") for i in range(6)]
    producer = run.start(rows, "--max-resident-tasks", "1")
    wait_for(lambda: agent_stats(run.servers, "math_agent")["requests"] >= 1, 60, "the first call")
    sid = keys.shard_id(RunDir(str(run.out)).url, "0")
    # Past a lease TTL from the first call, three or four of the six are still waiting.
    time.sleep(4.0)
    now = float(r.time()[0])
    waiting = r.zcount(keys.shard_waiting(sid), now, "+inf")
    started = agent_stats(run.servers, "math_agent")["requests"]
    assert producer.wait(120) == 0, run.log()
    assert started <= 3
    assert waiting == 6 - started
    assert len(rows_by_key(run.out / "rollouts-0.jsonl")) == 6
