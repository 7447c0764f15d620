"""The timeouts section (issue 40, item 1): failed rollouts joined with the model calls captured
under their ids, their `/run` time split into time in calls and time elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from infra.capture import CaptureStore
from infra.store import RunDir
from tests.health_fixtures import (
    failure,
    healthy_trajectory,
    owed,
    read_summary,
    record,
    write_lines,
)
from workers.health import plan_recheck, run_local
from workers.health.sources import source_for
from workers.health.timeouts import CAPTURE_OFF, DIR_UNREADABLE
from workers.report import write_report


def capture_line(start: float, stop: float) -> bytes:
    line = {
        "model_call_id": f"m{start}", "dialect": "responses", "started_at": start,
        "completed_at": stop, "latency_ms": round((stop - start) * 1000, 2), "status_code": 200,
        "response": {"id": "r", "output": [], "usage": {"input_tokens": 1, "output_tokens": 1}},
    }  # fmt: skip
    return orjson.dumps(line) + b"\n"


def failed(
    task: int, cls: str = "agent_request_failed", agent: str = "math_agent", **extra: Any
) -> dict[str, Any]:
    return {**failure(task, 0, cls, agent), "_ng_started_at": 1000.0, "_ng_run_ms": 3000.0, **extra}


def folder_with_failures(tmp_path: Path, capture: str | None) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    write_lines(folder / "rollouts-0.jsonl", [record(0, 0, traj=healthy_trajectory())])
    write_lines(folder / "rollouts-0_materialized_inputs.jsonl", owed(9, 1))
    rows = [
        failed(1),  # cut by its time limit after two calls
        failed(2, _ng_run_ms=5000.0),  # replayed: attempt 0 ...
        failed(2, _ng_attempt_index=1, _ng_run_ms=5000.0),  # ... and attempt 1, one delivery
        failed(3, ng_model_call_capture={"calls": []}),  # carries its own capture
        failed(4),  # no capture file: it never called the model
        failed(5),  # a capture write failed
        failed(6, cls="judge_failed", agent="other_agent"),
        failed(7, _ng_started_at=900.0),  # an earlier delivery of 7 ...
        failed(7, _ng_started_at=1000.0, _ng_attempt_index=1),  # ... and its latest
        failed(0),  # landed later: not failed, not in the section
    ]
    write_lines(folder / "rollouts-0_failures.jsonl", rows)
    settings = {"observability_enabled": capture is not None, "model_call_capture_dir": capture}
    (folder / "rollouts-0_manifest.json").write_bytes(orjson.dumps({"settings": settings}))
    return folder


def write_captures(url: str) -> None:
    store = CaptureStore(url)
    store.append("1-0", capture_line(100.0, 100.5))
    store.append("1-0", capture_line(101.0, 101.2))
    store.append("2-0", capture_line(10.0, 10.5))
    store.append("2-0-a1", capture_line(12.0, 13.0))
    store.append("2-0-a1", capture_line(12.5, 13.5))  # overlaps the one before: counted once
    store.append("5-0", capture_line(1.0, 2.0))
    store.mark_incomplete("5-0")
    store.append("6-0", capture_line(1.0, 1.25))
    store.append("7-0", capture_line(1.0, 9.0))  # the earlier delivery's: not this one's
    store.append("7-0-a1", capture_line(1.0, 2.0))


def test_failed_rollouts_are_joined_with_their_captured_calls(tmp_path: Path) -> None:
    capture = str(tmp_path / "calls")
    folder = folder_with_failures(tmp_path, capture)
    write_captures(capture)
    run = run_local(plan_recheck(str(folder)))
    assert read_summary(folder)["run"]["timeouts"] == run["timeouts"]
    assert run["timeouts"] == {
        "state": "observed",
        "unobserved_reason": None,
        "groups": [
            {
                "failure_class": "agent_request_failed", "agent": "math_agent", "rollouts": 6,
                "measured": 3, "model_calls": 6,
                # 1-0: 0.7 s of 3 s; 2-0: 0.5 + 1.5 s of 5 s; 7-0: 1 s of 3 s
                "model_call_s": 3.7, "other_s": 7.3,
                "unmeasured": {"own_capture": 1, "no_capture": 1, "capture_incomplete": 1},
            },
            {
                "failure_class": "judge_failed", "agent": "other_agent", "rollouts": 1,
                "measured": 1, "model_calls": 1, "model_call_s": 0.25, "other_s": 2.75,
                "unmeasured": {},
            },
        ],
    }  # fmt: skip
    assert run["accounting"]["failed"]["total"] == 7


def test_a_missing_capture_dir_leaves_the_section_unobserved(tmp_path: Path) -> None:
    folder = folder_with_failures(tmp_path, str(tmp_path / "never-created"))
    run = run_local(plan_recheck(str(folder)))
    timeouts = run["timeouts"]
    assert timeouts is not None
    assert (timeouts["state"], timeouts["unobserved_reason"]) == ("unobserved", DIR_UNREADABLE)
    assert [(g["failure_class"], g["rollouts"]) for g in timeouts["groups"]] == [
        ("agent_request_failed", 6),
        ("judge_failed", 1),
    ]
    assert "measured" not in timeouts["groups"][0]
    assert not (tmp_path / "never-created").exists()  # listed, never created
    assert run["state"] == "complete"  # the check ran as ever


def test_capture_off_is_unobserved_and_the_recheck_takes_a_capture_dir(tmp_path: Path) -> None:
    folder = folder_with_failures(tmp_path, None)
    timeouts = run_local(plan_recheck(str(folder)))["timeouts"]
    assert timeouts is not None and timeouts["unobserved_reason"] == CAPTURE_OFF
    capture = str(tmp_path / "elsewhere")
    write_captures(capture)
    timeouts = run_local(plan_recheck(str(folder), capture_dir=capture))["timeouts"]
    assert timeouts is not None and timeouts["state"] == "observed"
    assert timeouts["groups"][0]["measured"] == 3


def test_the_report_shows_the_section_and_names_the_faulted_call(tmp_path: Path) -> None:
    capture = str(tmp_path / "calls")
    folder = folder_with_failures(tmp_path, capture)
    write_captures(capture)
    traj = healthy_trajectory()
    traj["model_calls"][0]["response"] = {"status": "completed", "output": []}
    write_lines(folder / "rollouts-0.jsonl", [record(0, 0, traj=traj)])
    run_local(plan_recheck(str(folder)))
    rd = RunDir(str(folder))
    path, _ = write_report(rd, [source_for(rd, "rollouts-0.jsonl", "rollouts-0.jsonl")])
    html = Path(path).read_text()
    assert '<section id="timeouts"><h2>Timeouts</h2>' in html
    assert "3.70 s" in html and "7.30 s" in html  # agent_request_failed: in calls, elsewhere
    assert "own_capture 1, no_capture 1, capture_incomplete 1" in html
    assert "(call c1)" in html  # the empty call the finding names
