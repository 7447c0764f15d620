"""Hostile replies through real workers (issue 13 items 2 and 3): huge and gzip-bomb replies are
cut at `max_reply_bytes` without the worker's memory following them, a stalled body is cut by the
read-idle timeout, and a redirect is never followed; the small rollouts beside them all land.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples.agent_server import AgentKnobs
from tests.helpers import agent_stats, demo_rows
from tests.ops_helpers import manifest, requests_per_key, rows_by_key
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

HUGE_MB = 300
PEAK_RSS_LIMIT_KB = 500 * 1024
FAULTS: dict[int, str] = {
    3: "huge",
    8: "gzip_bomb",
    12: "huge",
    5: "redirect307",
    9: "redirect302",
    14: "stall",
}
ROWS = 24


def peak_rss_kb(pid: int) -> int:
    """The process's own high-water mark of resident memory (`VmHWM`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def test_hostile_replies_fail_alone_and_the_worker_stays_small(
    make_run: MakeRun, tmp_path: Path
) -> None:
    log = tmp_path / "agent-requests.jsonl"
    run = make_run(knobs=AgentKnobs(request_log=str(log), huge_reply_mb=HUGE_MB), concurrency=16)
    rows = demo_rows(ROWS)
    for index, kind in FAULTS.items():
        rows[index]["fault"] = {"kind": kind, "times": 9}
    out = run.out
    settings = {
        "route_failures_to_sidecar": True,
        "read_idle_timeout_s": 3.0,
        "max_attempts": 2,
        "retry_backoff_s": 0.05,
    }
    code = run.execute(rows, settings)
    peak_kb = peak_rss_kb(run.workers.procs[0].pid)
    redirected = {
        agent: agent_stats(run.servers, agent)["redirected"] for agent in run.servers.agents
    }
    run.servers.stop()

    assert code == 0
    assert manifest(out)["state"] == "completed"
    results = rows_by_key(out / "rollouts-0.jsonl")
    failures: dict[Any, list[dict[str, Any]]] = rows_by_key(out / "rollouts-0_failures.jsonl")
    requests = requests_per_key(log, manifest(out)["run_id"])
    assert sorted(results) == [(i, 0) for i in range(ROWS) if i not in FAULTS]
    assert all(len(found) == 1 for found in results.values())

    for index, kind in FAULTS.items():
        rows_of = failures[(index, 0)]
        if kind in ("huge", "gzip_bomb"):
            assert len(rows_of) == 1 and requests[(index, 0)] == 1, "an oversize reply is final"
            assert rows_of[0]["_ng_failure_class"] == "agent_request_failed"
            assert rows_of[0]["_ng_failure_type"] == "ReplyTooLarge"
            assert "max_reply_bytes=67108864" in rows_of[0]["_ng_failure_message"]
        elif kind.startswith("redirect"):
            assert len(rows_of) == 1 and requests[(index, 0)] == 1
            assert rows_of[0]["_ng_failure_class"] == "agent_run_error"
            assert rows_of[0]["_ng_failure_http_status"] == int(kind[-3:])
            assert "/redirected; redirects are not followed" in rows_of[0]["_ng_failure_message"]
        else:
            assert len(rows_of) == 2 and requests[(index, 0)] == 2, "a stall is replayed"
            assert {r["failure_kind"] for r in rows_of} == {"transport_timeout"}
            assert {r["_ng_failure_type"] for r in rows_of} == {"ReadIdleTimeout"}
    assert redirected == {"math_agent": 0, "count_agent": 0}
    assert peak_kb < PEAK_RSS_LIMIT_KB, f"worker peak RSS {peak_kb / 1024:.0f} MB"
