"""Backpressure end to end, measured by the agent itself: an agent that answers 429 above K
concurrent calls is waited out by the whole fleet (issue 16, acceptance 1 and 3).

The agent's request log has a `start` and an `end` event per request; a 429's end event carries
its `retry_after`. No rollout may come back sooner than that after its 429.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from examples.agent_server import AgentKnobs
from infra.backoff import MIN_WAIT_S
from tests.helpers import agent_stats, math_rows, write_rows
from tests.ops_helpers import (
    cli,
    cli_background,
    manifest,
    request_log,
    requests_per_key,
    rows_by_key,
    wait_for,
)
from tests.runs import MakeRun
from workers.rollout.admission import DEFAULT_WINDOW_CAP

pytestmark = pytest.mark.integration

K = 8
RETRY_AFTER_S = 1.0
PER_RUN = 200
"""Rollouts of each of the three runs: 600 at most K in flight of 200 ms each take 15 s or more,
so the window is judged over 5 s or more after its first 10 s."""


def landed(out: Path) -> int:
    path = out / "rollouts-0.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def too_soon(log: list[dict[str, Any]]) -> list[tuple[Any, float]]:
    """Requests that followed their rollout's 429 sooner than its Retry-After: (key, gap)."""
    by_key: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for event in log:
        by_key[(event["run"], event["task"], event["rollout"])].append(event)
    early = []
    for key, events in by_key.items():
        events.sort(key=lambda e: (e["start"], e["event"] == "end"))
        limited_until = None
        for e in events:
            if e["event"] == "start" and limited_until is not None and e["start"] < limited_until:
                early.append((key, limited_until - e["start"]))
            if e["event"] == "end" and e["outcome"] == "rate_limited":
                limited_until = e["end"] + e["retry_after"]
    return early


@pytest.mark.parametrize(
    ("rollouts", "concurrency"),
    [(300, 64), pytest.param(2000, 256, marks=pytest.mark.bench)],
)
def test_a_rate_limited_agent_is_waited_out_by_the_fleet(
    make_run: MakeRun, redis_url: str, tmp_path: Path, rollouts: int, concurrency: int
) -> None:
    log = tmp_path / "requests.jsonl"
    knobs = AgentKnobs(
        latency_ms=200, rate_limit_above=K, retry_after_s=RETRY_AFTER_S, request_log=str(log)
    )
    run = make_run({"math_agent": "math_env"}, knobs, workers=2, concurrency=concurrency)
    out = run.out
    producer = run.start(math_rows(rollouts))
    wait_for(lambda: landed(out) >= rollouts // 4, 120, "a quarter of the results")
    during = cli("status", str(out), "--json", "--broker", redis_url)
    code = producer.wait(600)
    stats = agent_stats(run.servers, "math_agent")
    after = cli("status", str(out), "--json", "--broker", redis_url)
    run.servers.stop()
    assert code == 0, run.log()
    assert len(rows_by_key(out / "rollouts-0.jsonl")) == rollouts
    assert rows_by_key(out / "rollouts-0_failures.jsonl") == {}
    assert manifest(out)["state"] == "completed"
    events = request_log(log)
    assert too_soon(events) == []
    assert stats["completed"] == rollouts
    assert stats["rate_limited"] <= 0.5 * rollouts, stats
    # While it runs, status shows the agent's window; once finished, status reads the run's files
    # (no window: nothing runs), and the shard's waits are one per 429 the agent sent.
    assert during.returncode == 0, during.stdout + during.stderr
    live = json.loads(during.stdout)["by_agent"]["math_agent"]
    assert 1 <= live["window"] <= DEFAULT_WINDOW_CAP and live["window_cap"] == DEFAULT_WINDOW_CAP
    assert live["waiting_for_agent"] >= 0
    assert after.returncode == 0, after.stdout + after.stderr
    done = json.loads(after.stdout)["by_agent"]["math_agent"]
    assert done.get("window") is None and done.get("waiting_for_agent", 0) == 0
    assert done.get("rate_limit_waits", 0) == stats["rate_limited"]
    if stats["rate_limited"]:
        assert done["rate_limit_waited_s"] >= stats["rate_limited"] * RETRY_AFTER_S
    # The final status file and the quality summary's accounting record the same waits: slow
    # start grows the window past K until the first 429, so there are some, and each 429 the agent
    # sent was waited out (none gave up: the budget is 15 min), at least its Retry-After each.
    status = json.loads((out / "rollouts-0_status.json").read_bytes())
    accounting = json.loads((out / "quality_summary.json").read_bytes())["run"]["accounting"]
    for waits in (status["rate_limit_waits"], accounting["rate_limit_waits"]):
        assert set(waits) == {"math_agent"}, waits
        count, seconds = waits["math_agent"]["count"], waits["math_agent"]["seconds"]
        assert count == stats["rate_limited"] > 0, (waits, stats)
        assert seconds >= count * RETRY_AFTER_S
    assert accounting["rate_limit_waits"] == {
        "math_agent": {
            k: pytest.approx(v) for k, v in status["rate_limit_waits"]["math_agent"].items()
        }
    }


def test_an_agent_that_rate_limits_forever_fails_each_rollout_within_the_bound(
    make_run: MakeRun, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    knobs = AgentKnobs(rate_limit_above=0, retry_after_s=RETRY_AFTER_S, request_log=str(log))
    run = make_run({"math_agent": "math_env"}, knobs, concurrency=16)
    budget_s = 3.0
    out = run.out
    proc = run.cli(
        math_rows(20), "+route_failures_to_sidecar=true", f"+rate_limit_budget_s={budget_s:g}"
    )
    run.servers.stop()
    assert manifest(out)["state"] in ("completed", "failed"), proc.stdout + proc.stderr
    assert rows_by_key(out / "rollouts-0.jsonl") == {}
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert sorted(failures) == [(i, 0) for i in range(20)]
    for [row] in failures.values():
        assert row["_ng_failure_class"] == "agent_request_failed"
        assert row["failure_kind"] == "rollouts:rate_limited"
        assert row["_ng_failure_http_status"] == 429
        assert "rate_limit_budget_s=3s" in row["_ng_failure_message"]
    # The bound for one delivery (docs/how-to/rate-limits.md): 1 + floor(budget / MIN_WAIT_S) rate-limited requests.
    bound = 1 + int(budget_s // max(MIN_WAIT_S, RETRY_AFTER_S))
    per_key = requests_per_key(log)
    assert max(per_key.values()) <= bound, per_key
    assert too_soon(request_log(log)) == []


def most_concurrent(log: list[dict[str, Any]], after: float) -> int:
    """The most requests the agent held at once from `after` on (its own start/end events)."""
    edges = sorted((e["start"], 1) if e["event"] == "start" else (e["end"], -1) for e in log)
    held = peak = 0
    for when, step in edges:
        held += step
        if when >= after:
            peak = max(peak, held)
    return peak


def test_three_runs_at_once_share_the_agents_window(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "requests.jsonl"
    knobs = AgentKnobs(
        latency_ms=200, rate_limit_above=K, retry_after_s=RETRY_AFTER_S, request_log=str(log)
    )
    run = make_run({"math_agent": "math_env"}, knobs, workers=2, concurrency=64)
    producers = []
    for i in range(3):
        producer = cli_background(
            "run", "--config", run.config, "--output-dir", str(tmp_path / f"run{i}"),
            "--input", write_rows(tmp_path / f"rows{i}.jsonl", math_rows(PER_RUN)),
            "--broker", redis_url, log=tmp_path / f"run{i}.log",
        )  # fmt: skip
        producers.append(producer)
    codes = [producer.wait(600) for producer in producers]
    run.servers.stop()
    assert codes == [0, 0, 0], [(tmp_path / f"run{i}.log").read_text() for i in range(3)]
    for i in range(3):
        assert len(rows_by_key(tmp_path / f"run{i}" / "rollouts-0.jsonl")) == PER_RUN
    events = request_log(log)
    first = min(e["start"] for e in events)
    assert most_concurrent(events, first + 10.0) <= K + 2
    assert too_soon(events) == []


def test_rollouts_sleeping_out_a_long_retry_after_are_not_a_stall(make_run: MakeRun) -> None:
    knobs = AgentKnobs(rate_limit_above=0, retry_after_s=3.0)
    run = make_run({"math_agent": "math_env"}, knobs, concurrency=4)
    out = run.out
    proc = run.cli(
        math_rows(4), "+route_failures_to_sidecar=true", "+rate_limit_budget_s=7",
        "+stall_timeout_s=2",
    )  # fmt: skip
    assert "stalled" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert sorted(failures) == [(i, 0) for i in range(4)]
    assert {row["failure_kind"] for [row] in failures.values()} == {"rollouts:rate_limited"}
