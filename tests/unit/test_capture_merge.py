"""Golden tests of the capture merge: each capture gap kind gives NeMo Gym 0.7.0's record and,
through our health check, NeMo Gym's finding (docs/how-to/model-call-capture.md)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from infra.capture import CaptureStore
from schemas.messages import CallPolicy, CaptureRef, CollectRequest, RunRef
from workers.capture import capture_keys, clear_for, merge, merge_into
from workers.health.record_checks import check_record
from workers.health.reduce import verdict_of
from workers.health.registry import checks_in

MODEL_REF = {"type": "responses_api_models", "name": "policy_model"}
ROW = {"_ng_task_index": 3, "_ng_rollout_index": 1, "responses_create_params": {"input": "2+3?"}}


def line(
    text: str = "5",
    *,
    status: int = 200,
    session: str | None = "inv-1",
    usage: tuple[int, int] = (10, 3),
    at: float = 100.0,
    error: str | None = None,
) -> dict[str, Any]:
    """One capture line as the proxy writes it (NeMo Gym's fields)."""
    rid = f"resp_{uuid.uuid4().hex[:8]}"
    response: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "model": "example-model",
        "status": "completed" if status < 400 else "failed",
        "output": [
            {
                "type": "message",
                "id": f"msg_{rid}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": usage[0],
            "output_tokens": usage[1],
            "total_tokens": sum(usage),
            "input_tokens_details": {"cached_tokens": 2},
            "output_tokens_details": {"reasoning_tokens": 1},
        },
    }
    out: dict[str, Any] = {
        "model_call_id": uuid.uuid4().hex,
        "dialect": "responses",
        "model_ref": MODEL_REF,
        "started_at": at,
        "completed_at": at + 0.01,
        "latency_ms": 10.0,
        "latency_ttft_ms": 9.5,
        "status_code": status,
        "error_category": error,
        "request": {"model": "example-model", "input": [{"role": "user", "content": "2+3?"}]},
        "response": response,
    }
    if session is not None:
        out["client_session_id"] = session
    return out


def result(usage: tuple[int, int] = (10, 3)) -> dict[str, Any]:
    """The example agent's /run reply: its transcript and its one invocation."""
    return {
        **ROW,
        "reward": 1.0,
        "response": {
            "id": "resp_agent",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "5"}],
                }
            ],
            "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
        },
        "ng_agent_observations": {
            "source": "example_agent",
            "records": [
                {
                    "kind": "agent_invocation",
                    "invocation_id": "inv-1",
                    "status": "completed",
                    "conversation": [{"role": "user", "content": "2+3?", "type": "message"}],
                }
            ],
        },
    }


def write(store: CaptureStore, key: str, *lines: dict[str, Any] | bytes) -> None:
    for item in lines:
        store.append(key, item if isinstance(item, bytes) else orjson.dumps(item) + b"\n")


@pytest.fixture
def store(tmp_path: Path) -> CaptureStore:
    return CaptureStore(str(tmp_path / "model-calls"))


def judged(merged: dict[str, Any]) -> tuple[str, list[Any], list[str]]:
    d = check_record(merged, frozenset())
    return verdict_of(d.findings, d.unobserved), d.findings, checks_in(d.unobserved)


def codes(block: dict[str, Any]) -> list[str]:
    return [g["code"] for g in block.get("gaps") or []]


def test_a_complete_capture_merges_as_nemo_gym_does_and_is_healthy(store: CaptureStore) -> None:
    write(store, "3-1", line())
    merged, read = merge(store, ROW, result(), run_latency_ms=5000)
    assert read
    capture = merged["ng_model_call_capture"]
    assert capture["rollout_id"] == "3-1"
    assert capture["metrics"] == {
        "tokens_in": 10, "tokens_out": 3, "tokens_reasoning": 1, "tokens_total": 13,
        "cached_tokens": 2, "latency_total_ms": 10.0, "num_calls": 1,
    }  # fmt: skip
    assert "gaps" not in capture
    assert not {"request", "response", "request_raw", "response_raw"} & set(capture["calls"][0])
    t = merged["ng_trajectory"]
    assert (t["task_id"], t["rollout_id"]) == ("3", "3-1")
    assert [g["code"] for g in t["gaps"]] == []
    assert t["turns"][0]["turn_no"] == 1 and t["turns"][0]["model_calls"][0]["model_call_id"]
    assert t["model_calls"][0]["token_stats"] == {
        "prompt_tokens": 10, "completion_tokens": 3, "reasoning_tokens": 1,
        "total_tokens": 13, "cached_tokens": 2,
    }  # fmt: skip
    assert merged["ng_perf"] == {
        "num_turns": 1, "num_tool_calls": 0, "token_observability_coverage": 1.0,
        "prompt_tokens": 10, "cached_prompt_tokens": 2, "completion_tokens": 3,
        "reasoning_tokens": 1, "total_latency_ms": 5000.0,
    }  # fmt: skip
    # No step_usage: our context-window check has no evidence, which leaves the verdict healthy.
    assert judged(merged) == ("healthy", [], ["rollout_context_window_exceeded"])


def test_no_capture_is_no_records_and_unobserved(store: CaptureStore) -> None:
    merged, _ = merge(store, ROW, result())
    assert codes(merged["ng_model_call_capture"]) == ["model_call_capture_no_records"]
    assert [g["code"] for g in merged["ng_trajectory"]["gaps"]] == [
        "model_call_capture_no_records",
        "model_calls_unavailable",
        "turns_unavailable",
    ]
    verdict, findings, unobserved = judged(merged)
    assert (verdict, findings) == ("unobserved", [])
    assert "rollout_missing_agent_turns" in unobserved and "model_call_failed" in unobserved


def test_the_incomplete_marker_leaves_model_calls_unobserved(store: CaptureStore) -> None:
    write(store, "3-1", line())
    store.mark_incomplete("3-1")
    merged, _ = merge(store, ROW, result())
    assert codes(merged["ng_model_call_capture"]) == ["model_call_capture_incomplete"]
    verdict, findings, unobserved = judged(merged)
    assert (verdict, findings) == ("unobserved", [])
    assert "model_call_failed" in unobserved
    assert "rollout_missing_agent_turns" not in unobserved  # the turns were observed


def test_unreadable_lines_are_counted_and_keep_their_call_index(store: CaptureStore) -> None:
    write(store, "3-1", b"{not json\n", b"\n", line(), b"[1, 2]\n")
    merged, _ = merge(store, ROW, result())
    capture = merged["ng_model_call_capture"]
    assert capture["gaps"] == [
        {"code": "model_call_capture_records_unreadable", "detail": "count=2"}
    ]
    assert [c["call_index"] for c in capture["calls"]] == [1]
    verdict, findings, _ = judged(merged)
    assert (verdict, findings) == ("unobserved", [])


def test_a_capture_that_cannot_be_read_is_unreadable(
    store: CaptureStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(key: str) -> tuple[bytes | None, bool]:
        raise OSError("disk gone")

    monkeypatch.setattr(store, "read", broken)
    merged, read = merge(store, ROW, result())
    assert not read
    assert codes(merged["ng_model_call_capture"]) == ["model_call_capture_unreadable"]
    assert merged["ng_model_call_capture"]["calls"] == []
    assert judged(merged)[:2] == ("unobserved", [])


def test_a_failed_call_is_found_as_nemo_gym_finds_it(store: CaptureStore) -> None:
    write(store, "3-1", line(at=100.0), line(status=500, error="upstream_error", at=101.0))
    merged, _ = merge(store, ROW, result(usage=(20, 6)))
    verdict, findings, _ = judged(merged)
    assert verdict == "unhealthy"
    assert [f[0] for f in findings] == ["rollout_ended_on_failed_model_call", "model_call_failed"]
    assert findings[1][2] == {"status": 500, "error_category": "upstream_error", "terminal": True}


def test_an_unowned_call_is_an_ownership_gap_and_no_turn(store: CaptureStore) -> None:
    judge = line(session=None)
    write(store, "3-1", line(), judge)
    merged, _ = merge(store, ROW, result())
    gaps = merged["ng_trajectory"]["gaps"]
    assert gaps == [
        {
            "code": "model_call_ownership_unavailable",
            "invocation_id": None,
            "detail": f"capture:{judge['model_call_id']}:call_index=1",
        }
    ]
    assert len(merged["ng_trajectory"]["turns"]) == 1
    assert judged(merged)[0] == "healthy"


def test_an_attempt_reads_its_own_key(store: CaptureStore) -> None:
    write(store, "3-1", line())
    write(store, "3-1-a2", line(), line())
    merged, _ = merge(store, ROW, {**result(), "_ng_attempt_index": 2})
    assert merged["ng_model_call_capture"]["rollout_id"] == "3-1-a2"
    assert merged["ng_trajectory"]["rollout_id"] == "3-1-a2"
    assert merged["ng_model_call_capture"]["metrics"]["num_calls"] == 2


def request(store: CaptureStore, delete: bool = False, **row: Any) -> CollectRequest:
    return CollectRequest(
        run=RunRef(run_id="r", output_dir="/x", token="t"),
        agent_url="http://a",
        policy=CallPolicy(max_attempts=3),
        row={**ROW, **row},
        capture=CaptureRef(dir=store.url, delete_after_merge=delete),
    )


def test_clear_removes_every_key_of_the_delivery_and_no_other(store: CaptureStore) -> None:
    req = request(store, _ng_attempt_index=1)
    assert capture_keys(req) == ["3-1-a1", "3-1-a2"]
    no_replays = req.model_copy(update={"policy": CallPolicy(max_attempts=3, retry_requests=False)})
    assert capture_keys(no_replays) == ["3-1-a1"]
    for key in ("3-1", "3-1-a1", "3-1-a2"):
        write(store, key, line())
    store.mark_incomplete("3-1-a1")
    clear_for(req)
    assert store.read("3-1")[0] is not None
    assert store.read("3-1-a1") == (None, False)
    assert store.read("3-1-a2") == (None, False)


def test_delete_after_merge_is_a_setting(store: CaptureStore) -> None:
    write(store, "3-1", line())
    merge_into(request(store), result())
    assert store.read("3-1")[0] is not None
    merged = merge_into(request(store, delete=True), result())
    assert merged["ng_model_call_capture"]["metrics"]["num_calls"] == 1
    assert store.read("3-1") == (None, False)


def test_without_payloads_the_trajectory_keeps_no_request_or_response_body(
    store: CaptureStore,
) -> None:
    write(store, "3-1", line())
    req = request(store).model_copy(
        update={"capture": CaptureRef(dir=store.url, include_payloads=False)}
    )
    merged = merge_into(req, result())
    [call] = merged["ng_trajectory"]["model_calls"]
    assert call["request"] is None and call["response"] is None
    assert call["token_stats"]["completion_tokens"] == 3 and call["duration_ms"] == 10.0
    assert merged["ng_perf"]["completion_tokens"] == 3
    with_payloads = merge_into(request(store), result())["ng_trajectory"]["model_calls"][0]
    assert with_payloads["request"]["input"][0]["content"] == "2+3?"


def test_without_a_capture_dir_nothing_is_merged(store: CaptureStore) -> None:
    req = request(store).model_copy(update={"capture": None})
    assert merge_into(req, result()) == result()


def test_an_invalid_producer_trajectory_is_a_gap_not_a_crash(store: CaptureStore) -> None:
    write(store, "3-1", line())
    merged, _ = merge(store, ROW, {**result(), "ng_trajectory": {"extra": 1}})
    assert "producer_trajectory_invalid" in [g["code"] for g in merged["ng_trajectory"]["gaps"]]


def test_a_capture_dir_that_cannot_be_opened_is_a_gap_not_a_failed_rollout(
    store: CaptureStore,
) -> None:
    req = request(store).model_copy(
        update={"capture": CaptureRef(dir="nosuchprotocol://bucket/calls")}
    )
    clear_for(req)  # logged, not raised
    merged = merge_into(req, result())
    assert codes(merged["ng_model_call_capture"]) == ["model_call_capture_unreadable"]
    assert judged(merged)[:2] == ("unobserved", [])
