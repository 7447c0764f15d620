"""Health that keeps the evidence, through real parts (issue 40, acceptance 1 and 3): Redis, a
Celery worker process, the example agents making 3-8 model calls per rollout through a
`rollouts capture-proxy` subprocess into the example model server, with injected truncated and
empty intermediate calls and rollouts cut by their time limit.

1. The findings name exactly the injected calls; the timeouts section counts the cut rollouts
   with their calls' time.
3. `rollouts status --json` shows verdict counts while the run runs that equal, at the end, the
   finish step's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from schemas import fields as F
from tests.evidence_run import FAULTS, HANGS, REPEATS, TASKS, EvidenceRun, calls_of, run_evidence
from tests.helpers import read_jsonl
from tests.ops_helpers import cli
from tests.runs import MakeRun
from workers.health.timeouts import in_calls_s

pytestmark = pytest.mark.integration

FAULT_CHECKS = {"truncated": ["rollout_response_truncated"], "empty": ["rollout_response_empty"],
                "truncated_empty": ["rollout_response_truncated", "rollout_response_empty"]}  # fmt: skip


@pytest.fixture
def evidence(make_run: MakeRun) -> EvidenceRun:
    return run_evidence(make_run)


def call_ids(record: dict[str, Any]) -> list[str]:
    """The rollout's captured calls' ids in call order."""
    calls = sorted(record["ng_model_call_capture"]["calls"], key=lambda c: c["call_index"])
    return [c["model_call_id"] for c in calls]


def capture_calls(capture_dir: Path, key: str) -> list[dict[str, Any]]:
    path = capture_dir / f"{key}.capture.jsonl"
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]
    return [{**x, "latency_total_ms": x["latency_ms"]} for x in lines]


@pytest.mark.timeout(600)
def test_the_findings_name_the_injected_calls_and_live_counts_match_the_finish(
    evidence: EvidenceRun, redis_url: str
) -> None:
    assert evidence.code == 0
    results = evidence.results()
    landed_tasks = [t for t in range(TASKS) if t not in HANGS]
    assert len(results) == len(landed_tasks) * REPEATS

    # 1a. Every landed rollout made its 3-8 calls, all captured and selected.
    expected: set[tuple[int, int, str, str]] = set()
    for r in results:
        task = r[F.TASK_INDEX]
        ids = call_ids(r)
        assert len(ids) == calls_of(task), task
        for index, fault in FAULTS.get(task, {}).items():
            for check in FAULT_CHECKS[fault]:
                expected.add((task, r[F.ROLLOUT_INDEX], check, ids[int(index)]))
    lines = read_jsonl(evidence.out / "rollout_verdicts.jsonl")
    found = {
        (v[F.TASK_INDEX], v[F.ROLLOUT_INDEX], f["check"], f["locator"]["call_id"])
        for v in lines
        for f in v["findings"]
        if f["check"] in ("rollout_response_truncated", "rollout_response_empty")
    }
    assert len(expected) == 2 * 6  # per repeat: 1 + 1 + 2 + 2 injected faults
    assert found == expected  # exactly the injected calls, none else
    for v in lines:
        assert len(v["calls"]["selected"]) == calls_of(v[F.TASK_INDEX])
        faulted = {
            c for t, ro, _, c in expected if (t, ro) == (v[F.TASK_INDEX], v[F.ROLLOUT_INDEX])
        }
        assert set(v["calls"]["faulted"]) == faulted
    # An empty call is also what NeMo Gym's zero-completion check names (the same call id).
    zero = {(v[F.TASK_INDEX], f["locator"]["call_id"]) for v in lines for f in v["findings"]
            if f["check"] == "model_call_zero_completion_tokens"}  # fmt: skip
    assert zero == {
        (t, c) for t, _, check, c in expected if t in (2, 4) and check.endswith("empty")
    }

    # 1b. The cut rollouts in the timeouts section, with their calls' time.
    failures = evidence.failures()
    assert sorted((f[F.TASK_INDEX], f[F.FAILURE_CLASS]) for f in failures) == sorted(
        (t, "agent_request_failed") for t in HANGS for _ in range(REPEATS)
    )
    summary = evidence.summary()
    section = summary["timeouts"]
    assert section["state"] == "observed"
    groups = {g["agent"]: g for g in section["groups"]}
    for task, made in HANGS.items():
        rows = [f for f in failures if f[F.TASK_INDEX] == task]
        agent = F.agent_name(rows[0])
        in_calls = sum(
            in_calls_s(capture_calls(evidence.capture_dir, str(F.rollout_id(f)))) or 0 for f in rows
        )
        run_s = sum(f[F.RUN_MS] for f in rows) / 1000
        g = groups[agent]
        assert (g["failure_class"], g["rollouts"], g["measured"]) == (
            "agent_request_failed",
            REPEATS,
            REPEATS,
        )
        assert g["model_calls"] == made * REPEATS and g["unmeasured"] == {}
        assert g["model_call_s"] == pytest.approx(in_calls, abs=0.002)
        assert g["model_call_s"] + g["other_s"] == pytest.approx(run_s, abs=0.004)
        assert g["other_s"] > g["model_call_s"]  # most of a hung rollout's time is the agent's

    # 3. Live verdict counts mid-run, and at the end the finish step's.
    final = summary["verdicts"]
    running = [s for s in evidence.statuses if s["state"] == "running" and s["health"]["live"]]
    assert running, [s["state"] for s in evidence.statuses]
    for s in running:
        live = s["health"]["live"]["verdicts"]
        assert all(live[k] <= final[k] for k in final), (live, final)
        assert sum(live.values()) <= s["landed"]
    # While the cut rollouts still ran, every other result had landed: the counts then are the
    # finish step's.
    assert any(s["health"]["live"]["verdicts"] == final for s in running)
    done = cli("status", str(evidence.out), "--json", "--redis", redis_url)
    status = orjson.loads(done.stdout)
    assert status["state"] == "completed"
    assert status["health"]["summary"] == final
    assert status["health"]["live"]["verdicts"] == final
    issues = {c: n for c, n in summary["issues"].items() if n and c not in (
        "task_consistently_unhealthy", "task_no_successful_model_calls", "run_excessive_failures")}  # fmt: skip
    assert status["health"]["live"]["issues"] == issues
