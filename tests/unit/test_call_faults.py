"""Per-call faults of a multi-turn rollout, and the typed check contract (issue 40, item 2 and 6).

The selected calls are the verified successful raw model responses bound to agent turns of a
complete call scope; `rollout_response_truncated` and `rollout_response_empty` judge each one on
its raw output and name it by its call id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from schemas.health import CheckInput, CheckScope, CheckSpec, CheckSubject
from tests.health_fixtures import (
    call,
    check_rollouts_file,
    read_verdicts,
    record,
    trajectory,
    turn,
    write_lines,
)
from tests.helpers import ROOT
from workers.health.record_checks import check_record
from workers.health.reduce import verdict_of
from workers.health.registry import REGISTRY, checks_in, validate_registry

FAULTS = ["rollout_response_truncated", "rollout_response_empty"]


def text(t: str) -> dict[str, Any]:
    return {
        "status": "completed",
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}],
    }  # fmt: skip


def cut(t: str) -> dict[str, Any]:
    return {
        **text(t),
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
    }


def multi_turn(calls: list[dict[str, Any]]) -> dict[str, Any]:
    turns = [turn(i, "step", (c["model_call_id"],)) for i, c in enumerate(calls)]
    return trajectory(turns, calls)


def findings(row: dict[str, Any], checks: list[str] = FAULTS) -> list[tuple[str, Any, Any]]:
    d = check_record(row, frozenset())
    return [f for f in d.findings if f[0] in checks]


def test_the_findings_name_exactly_the_cut_and_empty_intermediate_calls() -> None:
    calls = [
        call("c1", raw=text("thinking about it")),
        call("c2", finish="max_output_tokens", raw=cut("the answer is 4")),
        call("c3", status=500, error="upstream_error", raw={"error": {"message": "boom"}}),
        call("c4", raw={"status": "completed", "output": []}),
        call("c5", raw=text("4")),
    ]
    row = record(0, 0, traj=multi_turn(calls))
    d = check_record(row, frozenset())
    assert [f for f in d.findings if f[0] in FAULTS] == [
        ("rollout_response_truncated", {"call_id": "c2"}, {"finish_reason": "max_output_tokens"}),
        ("rollout_response_empty", {"call_id": "c4"}, {"reason": "empty"}),
    ]
    # The failed call is model_call_failed's (a trial matter), not judged for faults.
    assert d.selected == ["c1", "c2", "c4", "c5"]
    assert d.faulted == ["c2", "c4"]
    assert verdict_of(d.findings, d.unobserved) == "unhealthy"


def test_the_final_response_alone_is_no_longer_what_is_judged() -> None:
    calls = [
        call("c1", raw={"output": [{"type": "reasoning", "summary": []}]}),
        call("c2", raw=text("4")),
    ]
    row = record(0, 0, traj=multi_turn(calls))  # its final response is a clean "4"
    assert findings(row) == [
        ("rollout_response_empty", {"call_id": "c1"}, {"reason": "reasoning_only"})
    ]


@pytest.mark.parametrize(
    ("raw", "finish", "expected"),
    [
        # chat: cut by its length limit, and one with reasoning only
        ({"choices": [{"message": {"content": "part"}, "finish_reason": "length"}]}, "length",
         [("rollout_response_truncated", {"finish_reason": "length"})]),
        ({"choices": [{"message": {"content": "", "reasoning_content": "hm"}, "finish_reason": "stop"}]}, "stop",
         [("rollout_response_empty", {"reason": "reasoning_only"})]),
        ({"choices": [{"message": {"content": None, "tool_calls": [{"id": "t"}]}, "finish_reason": "tool_calls"}]},
         "tool_calls", []),
        # messages (Anthropic): max_tokens with text, and thinking only
        ({"content": [{"type": "text", "text": "part"}], "stop_reason": "max_tokens"}, "max_tokens",
         [("rollout_response_truncated", {"finish_reason": "max_tokens"})]),
        ({"content": [{"type": "thinking", "thinking": "hm"}], "stop_reason": "end_turn"}, "end_turn",
         [("rollout_response_empty", {"reason": "reasoning_only"})]),
        # a refusal that hit the length limit is a refusal, not a cut answer
        ({"choices": [{"message": {"content": None, "refusal": "no"}, "finish_reason": "length"}]}, "length", []),
        # a raw response that is not JSON is kept as its text: nothing usable
        ("<html>oops</html>", "stop", [("rollout_response_empty", {"reason": "malformed"})]),
    ],
)  # fmt: skip
def test_each_dialect_is_judged_on_its_raw_output(
    raw: Any, finish: str, expected: list[Any]
) -> None:
    row = record(
        0, 0, traj=multi_turn([call("c1", raw=raw, finish=finish), call("c2", raw=text("4"))])
    )
    assert [(c, det) for c, loc, det in findings(row)] == expected
    assert all(loc == {"call_id": "c1"} for _, loc, _ in findings(row))


def test_token_counts_alone_are_never_a_fault() -> None:
    calls = [call("c1", raw=text("4"), tokens={"prompt_tokens": 10, "completion_tokens": 0})]
    assert findings(record(0, 0, traj=multi_turn(calls))) == []


UNKNOWN = {
    "a call without an explicit status": lambda c: c["response_metadata"].pop("status_code"),
    "a call with a 1xx status": lambda c: c["response_metadata"].update(status_code=101),
    "a call without its raw response": lambda c: c.pop("response"),
}


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_a_call_that_is_not_verified_makes_the_population_unknown(name: str) -> None:
    calls = [call("c1", raw=cut("x"), finish="length"), call("c2", raw=text("4"))]
    UNKNOWN[name](calls[1])
    d = check_record(record(0, 0, traj=multi_turn(calls)), frozenset())
    # Not judged at all (the cut c1 is not reported on a partial population): unobserved.
    assert [f for f in d.findings if f[0] in FAULTS] == []
    assert set(FAULTS) <= set(checks_in(d.unobserved)) and d.selected is None


def test_an_incomplete_call_scope_makes_the_population_unknown() -> None:
    traj = multi_turn([call("c1", raw=cut("x"), finish="length")])
    traj["gaps"] = [
        {"code": "turn_model_call_scope_incomplete", "invocation_id": None, "detail": None}
    ]
    d = check_record(record(0, 0, traj=traj), frozenset())
    assert set(FAULTS) <= set(checks_in(d.unobserved)) and d.selected is None


def test_a_record_without_captured_calls_is_judged_on_its_final_response() -> None:
    row = record(
        0, 0, resp={**cut("partial"), "id": "r", "usage": {"input_tokens": 1, "output_tokens": 1}}
    )
    d = check_record(row, frozenset())
    assert [f[0] for f in d.findings] == ["rollout_response_truncated"]
    assert d.findings[0][1] is None and d.selected is None


def test_the_verdict_line_holds_call_ids_and_no_text(tmp_path: Path) -> None:
    calls = [
        call("c1", raw=text("SECRET-ANSWER")),
        call("c2", raw=cut("SECRET-CUT"), finish="length"),
    ]
    write_lines(tmp_path / "rollouts.jsonl", [record(0, 0, traj=multi_turn(calls))])
    check_rollouts_file(tmp_path)
    (line,) = read_verdicts(tmp_path)
    assert line["calls"] == {"selected": ["c1", "c2"], "faulted": ["c2"]}
    assert [f for f in line["findings"] if f["check"] in FAULTS] == [
        {
            "check": "rollout_response_truncated",
            "locator": {"call_id": "c2"},
            "detail": {"finish_reason": "length"},
        }
    ]
    assert b"SECRET" not in (tmp_path / "rollout_verdicts.jsonl").read_bytes()
    assert b"SECRET" not in (tmp_path / "quality_summary.json").read_bytes()


def test_a_check_reads_one_call_binding_view() -> None:
    with pytest.raises(ValidationError, match="both turn-bound and invocation-owned"):
        CheckSpec(
            id="x", scope=CheckScope.ROLLOUT, subject=CheckSubject.MODEL_CALL,
            reads=frozenset({CheckInput.RECORD, CheckInput.BOUND_CALLS, CheckInput.OWNED_MODEL_CALLS}),
        )  # fmt: skip
    with pytest.raises(ValidationError):
        CheckSpec(id="x", scope="nope", subject="model_call", reads=frozenset({"record"}))  # type: ignore[arg-type]


def test_the_registry_is_validated() -> None:
    validate_registry(REGISTRY)
    with pytest.raises(ValueError, match="not the checks"):
        validate_registry(REGISTRY[1:])
    task = REGISTRY[12].model_copy(update={"reads": frozenset({CheckInput.RECORD})})
    with pytest.raises(ValueError, match="a task check cannot read record"):
        validate_registry((*REGISTRY[:12], task, *REGISTRY[13:]))
    assert all(isinstance(i, CheckInput) for s in REGISTRY for i in s.reads)


def test_the_reference_page_lists_every_check_with_what_it_reads() -> None:
    page = (ROOT / "docs" / "reference" / "health-check-inputs.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[1] in ("rollout", "task", "run"):
            rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    assert list(rows) == [s.id for s in REGISTRY]
    for spec in REGISTRY:
        scope, subject, reads = rows[spec.id]
        assert (scope, subject) == (spec.scope.value, spec.subject.value), spec.id
        listed = [r.strip() for r in reads.split(",")]
        assert set(listed) == {i.value for i in spec.reads}, spec.id
        assert listed == [i.value for i in CheckInput if i in spec.reads], spec.id
    for value in CheckInput:  # every input is explained
        assert f"| `{value.value}` |" in page, value
