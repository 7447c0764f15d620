"""Golden tests: each way a trajectory breaks NeMo Gym 0.7.0's `TrajectoryRecord` gives the
peer's finding (`record_unreadable`, docs/reference/health-checks.md), and our own checks never
take a healthy verdict away when their evidence does not apply."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.health_fixtures import call, healthy_trajectory, record, trajectory, turn
from workers.health import record_checks
from workers.health.record_checks import check_record
from workers.health.reduce import verdict_of
from workers.health.registry import checks_in

UNREADABLE = (
    "record_unreadable",
    None,
    {"reason": "canonical trajectory is unreadable", "error": "ValidationError"},
)
Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    def edit(t: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = t
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return edit


_DELETE = object()


def _two_calls(t: dict[str, Any]) -> None:
    t["model_calls"].append(copy.deepcopy(t["model_calls"][0]))


def _two_turns(t: dict[str, Any]) -> None:
    t["turns"].append(copy.deepcopy(t["turns"][0]))


def _two_invocations(t: dict[str, Any]) -> None:
    t["invocations"] = [{"invocation_id": "main"}, {"invocation_id": "main"}]


def _tool_call(**fields: Any) -> Edit:
    def edit(t: dict[str, Any]) -> None:
        t["tool_calls"] = [{"invocation_id": "main", "tool_call_id": "tc1", **fields}]

    return edit


VIOLATIONS: dict[str, Edit] = {
    "extra key on the record": _set("extra", 1),
    "extra key on a turn": _set("turns.0.extra", 1),
    "extra key on a model call": _set("model_calls.0.call_index", 0),
    "extra key in response_metadata": _set("model_calls.0.response_metadata.started_at", 1.0),
    "extra key in token_stats": _set("model_calls.0.token_stats.input_tokens", 1),
    "extra key on a gap": _set("gaps", [{"code": "x", "why": "y"}]),
    "extra key on a call reference": _set("turns.0.model_calls", [{"model_call_id": "c1", "x": 1}]),
    "schema_version 1.1": _set("schema_version", "1.1"),
    "no task_id": _set("task_id", _DELETE),
    "no rollout_id": _set("rollout_id", _DELETE),
    "task_id not a string": _set("task_id", 7),
    "turn_no 0": _set("turns.0.turn_no", 0),
    "turn without timestamp": _set("turns.0.timestamp", _DELETE),
    "turn without invocation_id": _set("turns.0.invocation_id", _DELETE),
    "negative step_count": _set("turns.0.step_count", -1),
    "turn identity differs": _set("turns.0.rollout_id", "other"),
    "duplicate turn number": _two_turns,
    "duplicate model_call_id": _two_calls,
    "duplicate invocation_id": _two_invocations,
    "reference names no call": _set("turns.0.model_calls", [{"response_id": "resp-c1"}]),
    "negative prompt_tokens": _set("model_calls.0.token_stats.prompt_tokens", -1),
    "negative duration_ms": _set("model_calls.0.duration_ms", -1.0),
    "started_at not a number": _set("model_calls.0.started_at", "a"),
    "response_source not a literal": _set("model_calls.0.response_metadata.response_source", "x"),
    "model_ref of another type": _set(
        "model_calls.0.response_metadata.model_ref", {"type": "agents", "name": "p"}
    ),
    "invocation status not a literal": _set(
        "invocations", [{"invocation_id": "main", "status": "done"}]
    ),
    "tool call ends before it starts": _tool_call(started_at=2.0, completed_at=1.0),
    "tool call timing_source not a literal": _tool_call(timing_source="clock"),
    "turns not a list": _set("turns", {"0": 1}),
    "gap without code": _set("gaps", [{"detail": "x"}]),
    "response_metadata null": _set("model_calls.0.response_metadata", None),
}


def _record(edit: Edit | None = None, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    row = record(0, 0, traj=healthy_trajectory(), steps=steps)
    if edit is not None:
        edit(row["ng_trajectory"])
    return row


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_a_schema_violation_is_record_unreadable(name: str) -> None:
    d = check_record(_record(VIOLATIONS[name]), frozenset())
    assert d.findings == [UNREADABLE]
    assert verdict_of(d.findings, d.unobserved) == "unhealthy"


def test_extra_keys_inside_a_model_ref_are_ignored_as_nemo_gym_does() -> None:
    def edit(t: dict[str, Any]) -> None:
        ref = {"type": "responses_api_models", "name": "policy"}
        t["model_calls"][0]["response_metadata"]["model_ref"] = {**ref, "region": "eu"}
        t["turns"][0]["model_calls"] = [{"model_call_id": "c1", "model_ref": ref}]

    d = check_record(_record(edit), frozenset())
    assert d.findings == []
    assert verdict_of(d.findings, d.unobserved) == "healthy"


def test_ints_are_accepted_for_float_fields() -> None:
    d = check_record(_record(_set("turns.0.timestamp", 3)), frozenset())
    assert verdict_of(d.findings, d.unobserved) == "healthy"


def test_no_step_usage_does_not_make_a_healthy_record_unobserved() -> None:
    """The peer calls it healthy: our context-window check lacks evidence, which is no finding."""
    d = check_record(_record(steps=None), frozenset())
    assert d.findings == []
    assert "rollout_context_window_exceeded" in checks_in(d.unobserved)
    assert verdict_of(d.findings, d.unobserved) == "healthy"


def test_our_checks_still_add_findings_without_step_usage() -> None:
    row = _record(steps=None)
    row["ng_trajectory"]["model_calls"][0]["response"] = {"output": []}
    d = check_record(row, frozenset())
    assert [(f[0], f[1]) for f in d.findings] == [("rollout_response_empty", {"call_id": "c1"})]


def test_a_nemo_check_without_evidence_still_makes_the_record_unobserved() -> None:
    row = record(0, 0, traj=trajectory([turn(0, "4")], [call("c1")]), steps=None)
    d = check_record(row, frozenset())
    assert d.findings == []
    assert verdict_of(d.findings, d.unobserved) == "unobserved"


def test_a_check_that_raises_is_unobserved_with_a_check_execution_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(r: Any, t: Any) -> list[Any]:
        raise TypeError("boom")

    monkeypatch.setitem(record_checks.TRAJECTORY_CHECKS, "model_call_failed", broken)
    d = check_record(_record(), frozenset())
    assert d.findings == [
        (
            "check_execution_error",
            None,
            {
                "reason": "check raised an unexpected exception",
                "failed_check": "model_call_failed",
                "error": "TypeError",
            },
        )
    ]
    assert "model_call_failed" in checks_in(d.unobserved)
