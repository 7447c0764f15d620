"""Builders of crafted rollout records and run folders for the health-check tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from infra.store import RunDir
from workers.health import make_plan, run_local
from workers.health.sources import source_for

CALL_CHECKS = [
    "model_call_zero_completion_tokens",
    "model_call_missing_token_counts",
    "trajectory_capture_mismatch",
    "model_call_failed",
    "rollout_token_count_mismatch",
    "model_call_runaway_generation",
]
"""The trajectory checks that read the rollout's model calls (those it owns or binds to turns):
unobserved where the calls' population is unknown."""
TRAJECTORY_CHECKS = [
    "rollout_missing_agent_turns",
    "rollout_ended_on_failed_model_call",
    "agent_turn_hollow",
    *CALL_CHECKS,
]


def response(
    text: str | None = "4",
    *,
    status: str = "completed",
    reason: str | None = None,
    output: list[Any] | None = None,
    usage: tuple[int, int] = (10, 5),
) -> dict[str, Any]:
    if output is None:
        output = [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ]
    out: dict[str, Any] = {
        "id": "resp",
        "status": status,
        "output": output,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }
    if reason is not None:
        out["incomplete_details"] = {"reason": reason}
    return out


def call(
    cid: str,
    *,
    status: int = 200,
    finish: str = "stop",
    tokens: dict[str, int] | None = None,
    started_at: Any = None,
    error: str | None = None,
    raw: Any = "default",
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "response_id": f"resp-{cid}",
        "model_ref": {"type": "responses_api_models", "name": "policy"},
        "status_code": status,
        "finish_reason": finish,
        "error_category": error,
    }
    c: dict[str, Any] = {
        "model_call_id": cid,
        "response_metadata": meta,
        "token_stats": tokens
        if tokens is not None
        else {"prompt_tokens": 10, "completion_tokens": 5},
        "response": {"output_text": "x"} if raw == "default" else raw,
    }
    if started_at is not None:
        c["started_at"] = started_at
    return c


def turn(n: int, answer: Any = "ok", refs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Turn `n` (0-based; its `turn_no` is n + 1), identity stamped by `record`."""
    return {
        "invocation_id": "main",
        "task_id": "t",
        "rollout_id": "r",
        "turn_no": n + 1,
        "timestamp": float(n),
        "step_count": 0,
        "answer": answer,
        "model_calls": [{"model_call_id": r} for r in refs],
    }


def trajectory(
    turns: list[dict[str, Any]],
    calls: list[dict[str, Any]],
    gaps: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    return {
        "schema_version": "1.0",
        "task_id": "t",
        "rollout_id": "r",
        "invocations": [],
        "turns": turns,
        "model_calls": calls,
        "tool_calls": [],
        "gaps": list(gaps),
    }


STEPS_OK = [{"step_number": 1, "status": "generated"}]


def record(
    task: int | None,
    rollout: int,
    *,
    traj: dict[str, Any] | None = None,
    resp: dict[str, Any] | None = None,
    steps: list[dict[str, Any]] | None = STEPS_OK,
    reward: Any = 1.0,
    agent: str = "math_agent",
    env: str = "math_env",
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "_ng_rollout_index": rollout,
        "agent_ref": {"name": agent},
        "_ng_environment_server": env,
        "reward": reward,
        "response": resp if resp is not None else response(),
    }
    if task is not None:
        row["_ng_task_index"] = task
    if traj is not None:
        row["ng_trajectory"] = _stamped(traj, task, rollout)
    if steps is not None:
        row["step_usage"] = steps
    return row


def _stamped(traj: dict[str, Any], task: int | None, rollout: int) -> dict[str, Any]:
    """The trajectory with the record's identity on it and its turns (as the merge writes it)."""
    if not isinstance(traj.get("turns"), list) or traj.get("rollout_id") != "r":
        return traj
    name = "unnumbered" if task is None else str(task)
    ids = {"task_id": name, "rollout_id": f"{name}-{rollout}"}
    turns = [{**t, **ids} if isinstance(t, dict) else t for t in traj["turns"]]
    return {**traj, **ids, "turns": turns}


def healthy_trajectory() -> dict[str, Any]:
    return trajectory([turn(0, "4", ("c1",))], [call("c1")])


def write_lines(path: Path, items: list[Any]) -> None:
    with open(path, "wb") as f:
        for item in items:
            f.write(item if isinstance(item, bytes) else orjson.dumps(item))
            f.write(b"\n")


def owed(tasks: int, repeats: int, agent: str = "math_agent", env: str = "math_env") -> list[Any]:
    return [
        {
            "_ng_task_index": t,
            "_ng_rollout_index": r,
            "agent_ref": {"name": agent},
            "_ng_environment_server": env,
            "responses_create_params": {"input": "q"},
        }
        for t in range(tasks)
        for r in range(repeats)
    ]


def failure(task: int, rollout: int, cls: str, agent: str = "math_agent") -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"name": agent},
        "_ng_environment_server": "math_env",
        "_ng_failure_class": cls,
        "_ng_failure_message": "boom",
    }


def check_rollouts_file(folder: Path) -> None:
    """The health check of `folder`'s `rollouts.jsonl` alone, run here (its scratch in `s`)."""
    rd = RunDir(str(folder))
    run_local(
        make_plan(
            rd.url,
            [source_for(rd, "rollouts.jsonl", "rollouts.jsonl")],
            scratch=str(folder / "s"),
        )
    )


def read_verdicts(folder: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line) for line in (folder / "rollout_verdicts.jsonl").read_bytes().splitlines()
    ]


def read_summary(folder: Path) -> dict[str, Any]:
    summary: dict[str, Any] = orjson.loads((folder / "quality_summary.json").read_bytes())
    return summary


def crafted_records() -> list[Any]:
    """One record per check (mostly), in file order; line numbers matter (see comments)."""
    return [
        record(0, 0, traj=healthy_trajectory()),  # line 1
        record(
            0,
            1,
            traj=trajectory(
                [turn(0, "", ("c1",)), turn(1, "done", ("c2",))], [call("c1"), call("c2")]
            ),
            resp=response(usage=(20, 10)),
        ),
        record(1, 0, traj=trajectory([turn(0, "", ())], [call("c1")])),
        record(
            1,
            1,
            traj=trajectory(
                [turn(0, "x", ("c1",)), turn(1, "y", ("c2",))],
                [
                    call("c1", started_at=1.0),
                    call(
                        "c2",
                        status=500,
                        error="server_error",
                        started_at=2.0,
                        tokens={"prompt_tokens": 10, "completion_tokens": 1},
                    ),
                ],
            ),
            resp=response(usage=(20, 6)),
        ),
        record(
            2,
            0,
            traj=trajectory(
                [turn(0, "cut", ("c1",))],
                [
                    call(
                        "c1",
                        finish="length",
                        tokens={"prompt_tokens": 10, "completion_tokens": 0},
                        raw={"output": []},
                    )
                ],
            ),
            resp=response(usage=(10, 0)),
        ),
        record(
            2,
            1,
            traj=trajectory([turn(0, "a", ("c1",))], [call("c1", tokens={"prompt_tokens": 10})]),
        ),
        record(3, 0, traj=trajectory([turn(0, "a", ("c1", "c9"))], [call("c1")])),
        record(3, 1, traj=healthy_trajectory(), resp=response(usage=(99, 5))),
        record(4, 0, traj={"turns": "nope"}),  # line 9
        record(
            4,
            1,
            traj=trajectory(
                [turn(0, "a", ("c1",)), turn(1, "b", ("c2",))],
                [call("c1", started_at="a"), call("c2", started_at=1)],
            ),
            resp=response(usage=(20, 10)),
        ),
        record(5, 0, resp=response("partial", status="incomplete", reason="max_output_tokens")),
        record(
            5,
            1,
            resp=response(
                output=[{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}]
            ),
        ),
        record(
            6,
            0,
            steps=[
                {"step_number": 1, "status": "generated"},
                {"step_number": 2, "status": "context_window_exceeded"},
            ],
        ),
        record(
            6,
            1,
            resp=response(
                status="incomplete",
                reason="max_output_tokens",
                output=[
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "refusal", "refusal": "I can't help with that"}],
                    }
                ],
            ),
        ),
        record(7, 0, traj=healthy_trajectory()),  # line 15
        b'{"_ng_task_index": 7, "_ng_rollout_index": ',  # line 16: unreadable
        record(7, 0, traj=healthy_trajectory()),  # line 17: the same rollout again
        record(7, 1, traj=healthy_trajectory()),
        b"",  # line 19: blank
        record(
            8,
            0,
            traj=trajectory(
                [turn(0, "a", ("c1",))],
                [call("c1", status=500, tokens={"prompt_tokens": 10, "completion_tokens": 1})],
            ),
            resp=response(usage=(10, 1)),
        ),
        record(
            8,
            1,
            traj=trajectory(
                [turn(0, "a", ("c1",))],
                [call("c1", status=500, tokens={"prompt_tokens": 10, "completion_tokens": 1})],
            ),
            resp=response(usage=(10, 1)),
        ),
        record(None, 0, traj=healthy_trajectory()),  # line 22: no task index; ordinal 20
    ]


def crafted_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    write_lines(folder / "rollouts-0.jsonl", crafted_records())
    write_lines(folder / "rollouts-0_materialized_inputs.jsonl", owed(10, 2))
    write_lines(
        folder / "rollouts-0_failures.jsonl",
        [
            failure(0, 0, "agent_request_failed"),  # landed later: not failed
            failure(9, 0, "agent_request_failed"),
            failure(9, 0, "agent_run_error"),  # the latest attempt stands
        ],
    )
    return folder
