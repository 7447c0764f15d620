"""Golden tests: crafted run folders, and every check's findings and verdict exactly as expected.

The expectations are written by hand from the rules (NeMo Gym 0.7.0's, docs/reference/health-checks.md), record by record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.health_fixtures import (
    CALL_CHECKS,
    TRAJECTORY_CHECKS,
    crafted_folder,
    failure,
    healthy_trajectory,
    owed,
    read_summary,
    read_verdicts,
    record,
    write_lines,
)
from workers.health import make_plan, plan_recheck, run_local, write_disabled

UNREADABLE_TASK = "__unreadable_record__:input-0:line-16"
MODEL = "responses_api_models/policy"
NO_LIMIT = (
    "run_excessive_failures is unobserved: no max_failed_rollouts or max_failed_fraction is set"
)


def f(check: str, detail: dict[str, Any], locator: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"check": check}
    if locator is not None:
        out["locator"] = locator
    out["detail"] = detail
    return out


FAILED_500 = {"status": 500, "error_category": None}
DUP = f("rollout_duplicate_identity", {"duplicate_count": 2})
FAULTS = ["rollout_response_truncated", "rollout_response_empty"]

# The calls judged for faults, and the faulted ones, of each record whose trajectory captured
# calls and whose call population is known (rollout_verdicts.jsonl's `calls`).
CALLS: dict[tuple[Any, int], tuple[list[str], list[str]]] = {
    (0, 0): (["c1"], []),
    (0, 1): (["c1", "c2"], []),
    (1, 1): (["c1"], []),  # c2 failed: a trial matter, left out
    (2, 0): (["c1"], ["c1"]),
    (2, 1): (["c1"], []),
    (3, 1): (["c1"], []),
    (7, 0): (["c1"], []),
    (7, 1): (["c1"], []),
    (8, 0): ([], []),
    (8, 1): ([], []),
    (20, 0): (["c1"], []),
}

# (task, rollout, rollout_id, verdict, findings, unobserved), in the order of rollout_verdicts.jsonl.
EXPECTED: list[tuple[Any, int, str, str, list[dict[str, Any]], list[str]]] = [
    (0, 0, "0-0", "healthy", [], []),
    (0, 1, "0-1", "unhealthy", [f("agent_turn_hollow", {"reason": "agent turn has no message or tool calls"}, {"turn": 1})], []),
    (
        1, 0, "1-0", "unhealthy",
        [
            f("rollout_missing_agent_turns", {"reason": "no agent turn with model activity"}),
            f("agent_turn_hollow", {"reason": "agent turn has no message or tool calls"}, {"turn": 1}),
        ],
        # Its one turn references no call: the calls' population is unknown.
        [*CALL_CHECKS, *FAULTS],
    ),
    (
        1, 1, "1-1", "unhealthy",
        [
            f(
                "rollout_ended_on_failed_model_call",
                {"model_ref": MODEL, "status": 500, "error_category": "server_error", "observed_calls": 2, "successful_calls": 1},
                {"call_id": "c2"},
            ),
            f("model_call_failed", {"status": 500, "error_category": "server_error", "terminal": True}, {"call_id": "c2"}),
        ],
        [],
    ),
    (
        2, 0, "2-0", "unhealthy",
        [
            f("model_call_zero_completion_tokens", {"completion_tokens": 0}, {"call_id": "c1"}),
            f("model_call_runaway_generation", {"finish_reason": "length"}, {"call_id": "c1"}),
            # The one selected call is cut and has no output: both faults name it.
            f("rollout_response_truncated", {"finish_reason": "length"}, {"call_id": "c1"}),
            f("rollout_response_empty", {"reason": "empty"}, {"call_id": "c1"}),
        ],
        [],
    ),
    (2, 1, "2-1", "unhealthy", [f("model_call_missing_token_counts", {"missing": ["completion_tokens"]}, {"call_id": "c1"})], ["rollout_token_count_mismatch"]),
    (3, 0, "3-0", "unhealthy", [f("trajectory_capture_mismatch", {"kind": "missing_captured_call"}, {"call_id": "c9"})], ["rollout_token_count_mismatch", *FAULTS]),
    (
        3, 1, "3-1", "unhealthy",
        [f("rollout_token_count_mismatch", {"transcript_prompt": 99, "transcript_completion": 5, "capture_prompt": 10, "capture_completion": 5})],
        [],
    ),
    (4, 0, "4-0", "unhealthy", [f("record_unreadable", {"reason": "canonical trajectory is unreadable", "error": "ValidationError"})], TRAJECTORY_CHECKS),
    # started_at "a" is not a float: NeMo Gym's TrajectoryRecord refuses it.
    (4, 1, "4-1", "unhealthy", [f("record_unreadable", {"reason": "canonical trajectory is unreadable", "error": "ValidationError"})], TRAJECTORY_CHECKS),
    (5, 0, "5-0", "unhealthy", [f("rollout_response_truncated", {"status": "incomplete", "reason": "max_output_tokens"})], TRAJECTORY_CHECKS),
    (5, 1, "5-1", "unhealthy", [f("rollout_response_empty", {"reason": "reasoning_only"})], TRAJECTORY_CHECKS),
    (6, 0, "6-0", "unhealthy", [f("rollout_context_window_exceeded", {"status": "context_window_exceeded"}, {"step_number": 2})], TRAJECTORY_CHECKS),
    (6, 1, "6-1", "unobserved", [], TRAJECTORY_CHECKS),
    (7, 0, "7-0", "unhealthy", [DUP], []),
    (7, 0, "7-0", "unhealthy", [DUP], []),
    (7, 1, "7-1", "healthy", [], []),
    (
        8, 0, "8-0", "unhealthy",
        [
            f("rollout_ended_on_failed_model_call", {"model_ref": MODEL, **FAILED_500, "observed_calls": 1, "successful_calls": 0}, {"call_id": "c1"}),
            f("model_call_failed", {**FAILED_500, "terminal": True}, {"call_id": "c1"}),
        ],
        FAULTS,  # its one call failed: no call is selected, no output to judge
    ),
    (
        8, 1, "8-1", "unhealthy",
        [
            f("rollout_ended_on_failed_model_call", {"model_ref": MODEL, **FAILED_500, "observed_calls": 1, "successful_calls": 0}, {"call_id": "c1"}),
            f("model_call_failed", {**FAILED_500, "terminal": True}, {"call_id": "c1"}),
        ],
        FAULTS,  # its one call failed: no call is selected, no output to judge
    ),
    (20, 0, "unnumbered-0", "healthy", [], []),
    (
        UNREADABLE_TASK, 0, f"{UNREADABLE_TASK}-0", "unhealthy",
        [f("record_unreadable", {"reason": "rollout record is unreadable", "error": "JSONDecodeError"}, {"source_file": "rollouts-0.jsonl", "line": 16})],
        [
            "check_execution_error", "rollout_duplicate_identity", *TRAJECTORY_CHECKS,
            "rollout_response_truncated", "rollout_response_empty", "rollout_context_window_exceeded",
        ],
    ),
]  # fmt: skip

EXPECTED_TASKS = {
    "0": (2, 1, 1, 0, []),
    "1": (2, 0, 2, 0, ["task_consistently_unhealthy"]),
    "2": (2, 0, 2, 0, ["task_consistently_unhealthy"]),
    "20": (1, 1, 0, 0, []),
    "3": (2, 0, 2, 0, ["task_consistently_unhealthy"]),
    "4": (2, 0, 2, 0, ["task_consistently_unhealthy"]),
    "5": (2, 0, 2, 0, ["task_consistently_unhealthy"]),
    "6": (2, 0, 1, 1, []),
    "7": (2, 1, 1, 0, []),
    "8": (2, 0, 2, 0, ["task_consistently_unhealthy", "task_no_successful_model_calls"]),
    UNREADABLE_TASK: (1, 0, 1, 0, []),
}


def check(folder: Path, **kwargs: Any) -> dict[str, Any]:
    run_local(plan_recheck(str(folder), **kwargs))
    return read_summary(folder)


def test_every_check_finding_and_verdict(tmp_path: Path) -> None:
    folder = crafted_folder(tmp_path)
    summary = check(folder)

    lines = read_verdicts(folder)
    expected_lines = [
        {
            "_ng_task_index": t,
            "_ng_rollout_index": r,
            "rollout_id": rid,
            "verdict": verdict,
            "findings": findings,
            "unobserved": unobserved,
            **(
                {"calls": dict(zip(("selected", "faulted"), CALLS[(t, r)], strict=True))}
                if (t, r) in CALLS
                else {}
            ),
        }
        for t, r, rid, verdict, findings, unobserved in EXPECTED
    ]
    assert lines == expected_lines

    tasks = summary["tasks"]
    assert list(tasks) == list(EXPECTED_TASKS)  # integer tasks by string form, then strings
    for key, (repeats, healthy, unhealthy, unobserved, flags) in EXPECTED_TASKS.items():
        assert tasks[key] == {
            "repeats": repeats,
            "healthy": healthy,
            "unhealthy": unhealthy,
            "unobserved": unobserved,
            "flags": flags,
        }, key

    run = summary["run"]
    assert run["artifacts"]["records"] == 21
    assert run["artifacts"]["captures"] == 14
    assert run["verdicts"] == {"healthy": 3, "unhealthy": 17, "unobserved": 1}
    assert run["issues"] == {
        "check_execution_error": 0,
        "record_unreadable": 3,
        "rollout_duplicate_identity": 2,
        "rollout_missing_agent_turns": 1,
        "rollout_ended_on_failed_model_call": 3,
        "agent_turn_hollow": 2,
        "model_call_zero_completion_tokens": 1,
        "model_call_missing_token_counts": 1,
        "trajectory_capture_mismatch": 1,
        "model_call_failed": 3,
        "rollout_token_count_mismatch": 1,
        "model_call_runaway_generation": 1,
        "task_consistently_unhealthy": 6,
        "task_no_successful_model_calls": 1,
        "rollout_response_truncated": 2,
        "rollout_response_empty": 2,
        "rollout_context_window_exceeded": 1,
        "run_excessive_failures": 0,
    }
    coverage = run["artifacts"]["coverage"]
    assert coverage["model_call_failed"] == {"evaluated": 13, "unobserved": 8, "ignored": 0}
    # Unobserved: the unreadable line, two records whose calls' population is unknown (1-0,
    # 3-0) and two whose only call failed (8-0, 8-1).
    assert coverage["rollout_response_truncated"] == {
        "evaluated": 16,
        "unobserved": 5,
        "ignored": 0,
    }
    assert coverage["task_consistently_unhealthy"] == {
        "evaluated": 8,
        "unobserved": 3,
        "ignored": 0,
    }
    assert coverage["task_no_successful_model_calls"] == {
        "evaluated": 5,
        "unobserved": 6,
        "ignored": 0,
    }
    assert coverage["run_excessive_failures"] == {"evaluated": 0, "unobserved": 1, "ignored": 0}
    assert run["stats"]["model_call_errors"] == {
        "total": 3,
        "by_status": {"500": 3},
        "rollouts_affected": 3,
        "ended_on_error": 3,
    }

    # The run accounting and the verdict: no limit set, so the run check is unobserved, but the
    # duplicate, observed, already makes the run unhealthy. The missing rollout is counted; it
    # is no reason either way (the verdict never certifies completeness).
    acc = run["accounting"]
    assert {k: acc[k] for k in ("owed", "landed", "scored", "missing", "drained", "duplicates", "not_owed", "unreadable")} == {
        "owed": 20, "landed": 18, "scored": 18, "missing": 1, "drained": None,
        "duplicates": 1, "not_owed": 1, "unreadable": 1,
    }  # fmt: skip
    assert acc["failed"] == {"total": 1, "by_class": {"agent_run_error": 1}}
    assert acc["run_excessive_failures"] == {
        "coverage": "unobserved",
        "unobserved_reason": "no max_failed_rollouts or max_failed_fraction is set",
        "findings": [],
    }
    assert run["state"] == "complete"
    assert run["healthy"] is False
    assert run["reasons"] == ["1 records repeat a rollout identity already recorded"]
    assert run["sources"] == ["rollouts-0.jsonl"]
    assert run["limits"] == {
        "max_failed_rollouts": None,
        "max_failed_fraction": None,
        "overrides": {},
    }


def test_limit_override_finds_the_failed_group(tmp_path: Path) -> None:
    folder = crafted_folder(tmp_path)
    run = check(folder, limit_overrides={"max_failed_rollouts": "1"})["run"]
    finding = {
        "check": "run_excessive_failures",
        "locator": {"agent": "math_agent", "_ng_environment_server": "math_env", "failure_class": "agent_run_error"},
        "detail": {
            "failed": 1, "owed": 20, "fraction": 0.05, "limits_reached": ["max_failed_rollouts"],
            "max_failed_rollouts": 1, "max_failed_fraction": None,
        },
        "verdict": "unhealthy",
        "reason": "1 of 20 rollouts of agent math_agent on math_env failed with agent_run_error (max_failed_rollouts=1)",
    }  # fmt: skip
    assert run["accounting"]["run_excessive_failures"]["findings"] == [finding]
    assert run["issues"]["run_excessive_failures"] == 1
    assert run["reasons"][0] == finding["reason"]
    assert run["limits"] == {
        "max_failed_rollouts": 1,
        "max_failed_fraction": None,
        "overrides": {"max_failed_rollouts": {"persisted": None, "value": 1}},
    }


def clean_folder(tmp_path: Path, limits: dict[str, Any] | None, failed: int = 0) -> Path:
    """3 tasks x 2 repeats, all owed; the last `failed` rollouts failed instead of landing."""
    folder = tmp_path / "clean"
    folder.mkdir()
    keys = [(t, r) for t in range(3) for r in range(2)]
    landed, lost = keys[: len(keys) - failed], keys[len(keys) - failed :]
    write_lines(
        folder / "rollouts-0.jsonl", [record(t, r, traj=healthy_trajectory()) for t, r in landed]
    )
    write_lines(folder / "rollouts-0_materialized_inputs.jsonl", owed(3, 2))
    write_lines(
        folder / "rollouts-0_failures.jsonl", [failure(t, r, "agent_run_error") for t, r in lost]
    )
    if limits is not None:
        (folder / "rollouts-0_manifest.json").write_bytes(orjson.dumps({"settings": limits}))
    return folder


def test_the_accounting_sums_each_agents_rate_limit_waits_from_the_status_records(
    tmp_path: Path,
) -> None:
    folder = clean_folder(tmp_path, None)
    for shard in ("1", "2"):
        for suffix in ("", "_materialized_inputs"):
            src = folder / f"rollouts-0{suffix}.jsonl"
            (folder / f"rollouts-{shard}{suffix}.jsonl").write_bytes(src.read_bytes())
    waits = {"a": {"count": 3, "seconds": 4.5}, "b": {"count": 1, "seconds": 0.125}}
    status = {"run_id": "r", "shard": "0", "planned": 6, "drained": 0, "rate_limit_waits": waits}
    (folder / "rollouts-0_status.json").write_bytes(orjson.dumps(status))
    status["rate_limit_waits"] = {"a": {"count": 2, "seconds": 2.0}}
    (folder / "rollouts-1_status.json").write_bytes(orjson.dumps(status))
    del status["rate_limit_waits"]  # a status record written before waits were recorded
    (folder / "rollouts-2_status.json").write_bytes(orjson.dumps(status))
    acc = check(folder)["run"]["accounting"]
    assert acc["rate_limit_waits"] == {
        "a": {"count": 5, "seconds": 6.5},
        "b": {"count": 1, "seconds": 0.125},
    }
    assert acc["drained"] == 0
    # No input records its waits: unknown, not zero.
    single = tmp_path / "single"
    single.mkdir()
    for name in (
        "rollouts-2.jsonl",
        "rollouts-2_materialized_inputs.jsonl",
        "rollouts-2_status.json",
    ):
        (single / name).write_bytes((folder / name).read_bytes())
    assert check(single)["run"]["accounting"]["rate_limit_waits"] is None


def test_whole_run_without_a_limit_is_unknown_not_healthy(tmp_path: Path) -> None:
    run = check(clean_folder(tmp_path, None))["run"]
    assert run["verdicts"] == {"healthy": 6, "unhealthy": 0, "unobserved": 0}
    assert run["accounting"]["run_excessive_failures"]["coverage"] == "unobserved"
    assert run["healthy"] is None
    assert run["reasons"] == [NO_LIMIT]


def test_whole_run_within_its_persisted_limit_is_healthy(tmp_path: Path) -> None:
    run = check(clean_folder(tmp_path, {"max_failed_fraction": 0.5}, failed=0))["run"]
    assert run["artifacts"]["coverage"]["run_excessive_failures"] == {
        "evaluated": 1,
        "unobserved": 0,
        "ignored": 0,
    }
    assert run["healthy"] is True
    assert run["reasons"] == []
    assert run["limits"]["max_failed_fraction"] == 0.5


def test_fraction_limit_reached(tmp_path: Path) -> None:
    run = check(clean_folder(tmp_path, {"max_failed_fraction": 0.25}, failed=2))["run"]
    acc = run["accounting"]
    assert acc["owed"] == 6 and acc["landed"] == 4 and acc["missing"] == 0
    [finding] = acc["run_excessive_failures"]["findings"]
    assert finding["detail"]["fraction"] == pytest.approx(2 / 6, abs=1e-6)
    assert finding["detail"]["limits_reached"] == ["max_failed_fraction"]
    assert run["healthy"] is False
    # Removing the persisted limit is recorded as an override, and leaves the check unobserved.
    run = check(tmp_path / "clean", limit_overrides={"max_failed_fraction": "none"})["run"]
    assert run["limits"]["overrides"] == {"max_failed_fraction": {"persisted": 0.25, "value": None}}
    assert run["healthy"] is None and run["reasons"] == [NO_LIMIT]


def test_limit_without_inventory_is_unobserved(tmp_path: Path) -> None:
    folder = clean_folder(tmp_path, None)
    run = check(
        folder, rollouts_file="rollouts-0.jsonl", limit_overrides={"max_failed_rollouts": "0"}
    )["run"]
    assert run["accounting"]["owed"] is not None  # the sidecars beside the file are found
    (folder / "rollouts-0_materialized_inputs.jsonl").unlink()
    run = check(
        folder, rollouts_file="rollouts-0.jsonl", limit_overrides={"max_failed_rollouts": "0"}
    )["run"]
    assert run["accounting"]["owed"] is None and run["accounting"]["missing"] is None
    assert run["accounting"]["run_excessive_failures"]["unobserved_reason"] == (
        "no materialized inputs to count owed rollouts against"
    )
    assert run["healthy"] is None


def test_ignored_checks_are_counted_as_ignored(tmp_path: Path) -> None:
    folder = crafted_folder(tmp_path)
    run = check(folder, ignored=["rollout_duplicate_identity", "run_excessive_failures"])["run"]
    assert run["ignored_checks"] == ["rollout_duplicate_identity", "run_excessive_failures"]
    assert run["issues"]["rollout_duplicate_identity"] == 0
    assert run["artifacts"]["coverage"]["rollout_duplicate_identity"]["ignored"] == 21
    assert run["artifacts"]["coverage"]["run_excessive_failures"] == {
        "evaluated": 0,
        "unobserved": 0,
        "ignored": 1,
    }
    lines = read_verdicts(folder)
    assert [line["verdict"] for line in lines if line["_ng_task_index"] == 7] == ["healthy"] * 3


def test_disabled_summary(tmp_path: Path) -> None:
    folder = tmp_path / "disabled"
    folder.mkdir()
    run = write_disabled(str(folder), ["rollouts-0.jsonl"], [], make_plan(str(folder), []).limits)
    summary = read_summary(folder)
    assert summary["run"] == run
    assert summary["tasks"] == {}
    assert run["state"] == "disabled"
    assert run["healthy"] is None
    assert run["reasons"] == ["the health check is disabled (disable_health_check)"]
    assert run["verdicts"] == {"healthy": None, "unhealthy": None, "unobserved": None}
    assert run["artifacts"]["records"] is None
    assert set(run["issues"].values()) == {None}
    assert run["accounting"]["landed"] is None and run["accounting"]["owed"] is None
    assert not (folder / "rollout_verdicts.jsonl").exists()


def test_shard_that_landed_nothing_is_still_accounted(tmp_path: Path) -> None:
    folder = tmp_path / "lost"
    folder.mkdir()
    write_lines(folder / "rollouts-0_materialized_inputs.jsonl", owed(1, 2))
    write_lines(folder / "rollouts-0_failures.jsonl", [failure(0, 0, "agent_run_error")])
    (folder / "rollouts-0_manifest.json").write_bytes(
        orjson.dumps({"settings": {"max_failed_rollouts": 1}})
    )
    run = check(folder)["run"]
    assert run["sources"] == ["rollouts-0.jsonl"]
    acc = run["accounting"]
    assert (acc["owed"], acc["landed"], acc["missing"], acc["failed"]["total"]) == (2, 0, 1, 1)
    assert run["healthy"] is False
    assert run["reasons"] == [
        "1 of 2 rollouts of agent math_agent on math_env failed with agent_run_error "
        "(max_failed_rollouts=1)"
    ]


def test_a_healthy_verdict_does_not_certify_completeness(tmp_path: Path) -> None:
    """Half the owed rollouts have no outcome and nothing read shows a problem: the run is
    healthy (within its limit), and its accounting still counts the missing ones."""
    folder = tmp_path / "half"
    folder.mkdir()
    write_lines(folder / "rollouts-0.jsonl", [record(0, 0, traj=healthy_trajectory())])
    write_lines(folder / "rollouts-0_materialized_inputs.jsonl", owed(1, 2))
    (folder / "rollouts-0_manifest.json").write_bytes(
        orjson.dumps({"settings": {"max_failed_rollouts": 1}})
    )
    run = check(folder)["run"]
    assert (run["accounting"]["owed"], run["accounting"]["missing"]) == (2, 1)
    assert (run["healthy"], run["reasons"]) == (True, [])


def test_earlier_summary_limits_are_read_without_its_tasks(tmp_path: Path) -> None:
    from infra.store import RunDir
    from workers.health.sources import earlier_run

    folder = crafted_folder(tmp_path)
    check(folder, limit_overrides={"max_failed_rollouts": "4"})
    run = earlier_run(RunDir(str(folder)))
    assert run == read_summary(folder)["run"]
    (folder / "quality_summary.json").write_bytes(orjson.dumps(read_summary(folder)))  # compact
    assert earlier_run(RunDir(str(folder))) == run
    # A merged folder's shards have no manifest here: the earlier summary's limits judge.
    (folder / "rollouts-0_manifest.json").unlink(missing_ok=True)
    assert check(folder)["run"]["limits"]["max_failed_rollouts"] == 4
