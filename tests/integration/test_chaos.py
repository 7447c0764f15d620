"""Chaos: faults, SIGKILLed workers and a Redis that restarts empty mid-run; then one resume.

The resume is for the Redis loss only: the killed workers' rollouts are taken over by the live
workers (rollout leases) before Redis restarts, without a resume.

Afterwards every planned rollout has exactly one landed result or a settled failure verdict
(terminal, or as many failed attempts as the limit), never both, and the agent's own request log
shows that every planned rollout was attempted.

The faults are the replayable kinds (502 and reset): with `retry_requests` each delivery replays
them up to the attempt limit, so one delivery settles a rollout. (A 500 is not replayed: such a
rollout stays retryable until resumes use up its attempts; the failure-class tests cover it.)
"""

from __future__ import annotations

import signal
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from examples.agent_server import AgentKnobs
from infra import keys
from infra.embedded import EmbeddedRedis
from infra.store import RunDir
from schemas import fields as F
from tests.cluster import ExampleServers, Workers
from tests.helpers import demo_rows, read_jsonl
from tests.ops_helpers import cli, key, landed_lines, manifest, requests_per_key, wait_for
from tests.runs import Run
from workers.shard.leases import lease_rows

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

MAX_ATTEMPTS = 3


@pytest.mark.timeout(600)
def test_chaos_run_then_resume_settles_every_rollout(
    private_redis: EmbeddedRedis, example_servers: ExampleServers, tmp_path: Path
) -> None:
    url = private_redis.url
    log = tmp_path / "agent-requests.jsonl"
    knobs = AgentKnobs(
        latency_ms=200,
        fault_rate=0.1,
        fault_kinds=["http502", "reset"],
        seed=7,
        request_log=str(log),
    )
    servers = example_servers(knobs=knobs)
    workers = Workers(url, tmp_path)
    run = Run(servers, url, tmp_path, workers)
    env = {"ROLLOUTS_LEASE_TTL_S": "5"}
    out = run.out
    results_file = out / "rollouts-0.jsonl"
    events: list[str] = []
    try:
        workers.start(count=2, concurrency=32, env=env)
        producer = run.start(
            demo_rows(1000), "--num-repeats", "2", "+route_failures_to_sidecar=true",
            "+stall_timeout_s=15",
        )  # fmt: skip
        for threshold, victim in ((300, 0), (700, 1)):

            def enough(t: int = threshold) -> bool:
                return landed_lines(out) >= t

            wait_for(enough, 120, f"{threshold} results")
            workers.procs[victim].send_signal(signal.SIGKILL)
            workers.procs[victim].wait(10)
            events.append(f"killed worker {victim} at {landed_lines(out)} results")
            workers.start(concurrency=32, env=env, wait=False)
        wait_for(lambda: landed_lines(out) >= 1100, 120, "1100 results")
        # The takeover waits out the dead holders' leases (a few seconds): the agent slows
        # down so that the run is still far from its end when Redis restarts. (At 200 ms it
        # could land all but a few dozen rollouts first, or all of them.)
        agent = servers.urls["math_agent"]
        httpx.post(agent + "/admin/knobs", json={"latency_ms": 2000}).raise_for_status()
        # No rollout is left with a dead holder: each was taken over by a live worker.
        killed = {f"{socket.gethostname()}:{workers.procs[v].pid}" for v in (0, 1)}
        r = redis.Redis.from_url(url)
        sid = keys.shard_id(RunDir(str(out)).url, "0")

        def taken_over() -> bool:
            return not any(row["holder"] in killed for row in lease_rows(r, sid))

        wait_for(taken_over, 60, "the killed workers' rollouts to be taken over")
        r.close()
        events.append(f"killed workers' rollouts taken over at {landed_lines(out)} results")
        private_redis.restart_empty()
        events.append(f"restarted Redis empty at {landed_lines(out)} results")
        httpx.post(agent + "/admin/knobs", json={"latency_ms": 200}).raise_for_status()

        # The chord and the queue are gone: the producer notices the stall and says to resume.
        assert producer.wait(300) == 1, run.log()
        run_log = run.log()
        assert "the run stalled" in run_log and f"rollouts resume file://{out}" in run_log
        before_resume = landed_lines(out)
        assert before_resume < 2000, events

        started = time.monotonic()
        proc = cli("resume", str(out), "--broker", url, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        events.append(f"resume took {time.monotonic() - started:.0f}s")
        print("\n".join(events))
    finally:
        run.stop_producers()
        workers.stop()
        servers.stop()

    planned = read_jsonl(out / "rollouts-0_materialized_inputs.jsonl")
    results = read_jsonl(results_file)
    failures = read_jsonl(out / "rollouts-0_failures.jsonl")
    planned_keys = {key(r) for r in planned}
    assert len(planned_keys) == len(planned) == 2000

    landed = Counter(key(r) for r in results)
    assert max(landed.values()) == 1, "a rollout landed twice"
    attempts = Counter(key(r) for r in failures)
    terminal = {key(r) for r in failures if r.get(F.FAILURE_TERMINAL)}
    settled_failed = {k for k in attempts if k in terminal or attempts[k] >= MAX_ATTEMPTS}
    assert not (settled_failed & set(landed)), "a rollout both landed and failed for good"
    unsettled = planned_keys - set(landed) - settled_failed
    assert not unsettled, f"{len(unsettled)} rollouts have no outcome: {sorted(unsettled)[:10]}"
    assert set(landed) <= planned_keys and set(attempts) <= planned_keys
    result_ids = {F.rollout_id(r) for r in results}
    failure_ids = {F.rollout_id(r) for r in failures}
    assert not (result_ids & failure_ids), "an attempt is both a result and a failure row"

    requested = requests_per_key(log)
    never_attempted = planned_keys - set(requested)
    assert not never_attempted, (
        f"planned rollouts never sent to the agent: {sorted(never_attempted)[:10]}"
    )
    assert len(failures) > 100, "the 10% injected faults left few failure rows"
    m = manifest(out)
    assert [g["kind"] for g in m["generations"]] == ["run", "resume"]
    assert m["state"] == "completed"
