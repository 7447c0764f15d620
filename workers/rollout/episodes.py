"""A materialized task row's `/run`: NeMo Gym's episode request, and the record its reply lands as.

An environment server runs a task row as one episode: `POST /run` with
`{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id", "task_input"}}` (the rollout id
without its `-a<n>` suffix, the attempt apart; the capture key is `rollout_id-a<attempt>` when the
attempt is above 0, as for any rollout). It answers NeMo Gym's `BaseEpisodeResponse`: the same
`episode_id` and `task_id`, and exactly one of `result` and `failure`.

A `result` lands as the environment server returned it, plus `_ng_task_id` and the planned row's
identity: it may not use the keys collection writes itself (`_ng_*`, `ng_trajectory`,
`ng_model_call_capture`, `ng_perf`). A `failure` is the server's own failure row,
`environment_server_failed`, terminal when it says so. A reply of any other shape fails the
attempt as `agent_request_failed`, like a reply that is not a JSON object.
"""

from __future__ import annotations

from typing import Any, TypedDict

import orjson

from schemas import fields as F

ENVIRONMENT_FAILURE_CLASS = "environment_server_failed"
COLLECTOR_KEYS = frozenset({"ng_trajectory", "ng_model_call_capture", "ng_perf"})


class InvalidEpisodeReply(ValueError):
    """Raised for a reply to an episode request that is no episode response of that episode."""

    def __init__(self, message: str, reply: dict[str, Any]) -> None:
        super().__init__(message)
        self.reply = reply


class EpisodeRef(TypedDict):
    """NeMo Gym's `episode_id` of an episode request."""

    rollout_id: str | None
    attempt: int


def episode_id(row: dict[str, Any]) -> EpisodeRef:
    """The episode's `{"rollout_id", "attempt"}`: the rollout id at attempt 0, and the attempt."""
    attempt = row.get(F.ATTEMPT_INDEX) or 0
    first = {k: v for k, v in row.items() if k != F.ATTEMPT_INDEX}
    return {"rollout_id": F.rollout_id(first), "attempt": attempt}


def episode_body(row: dict[str, Any]) -> bytes:
    """The `/run` body of a planned task row: NeMo Gym's episode request."""
    task = {F.TASK_ID: row[F.TASK_ID], F.TASK_INPUT: row[F.TASK_INPUT]}
    return orjson.dumps({"episode_id": episode_id(row), "task": task})


def _refused(message: str, reply: dict[str, Any]) -> InvalidEpisodeReply:
    return InvalidEpisodeReply(message, reply)


def episode_record(reply: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The record a task row's reply lands as (its identity is stamped afterwards); raises
    InvalidEpisodeReply for a reply that is no episode response of this episode."""
    task_id = row[F.TASK_ID]
    if not (
        isinstance(reply.get("episode_id"), dict)
        and isinstance(reply.get("task_id"), dict)
        and ("result" in reply or "failure" in reply)
    ):
        raise _refused(
            "/run reply to an episode request is not an episode response (episode_id, task_id "
            "and a result or a failure)",
            reply,
        )
    if reply["task_id"] != task_id:
        raise _refused(
            f"the episode response names task {reply['task_id']!r}, not {task_id!r}", reply
        )
    if reply["episode_id"] != episode_id(row):
        raise _refused(
            f"the episode response names episode {reply['episode_id']!r}, not {episode_id(row)!r}",
            reply,
        )
    result, failure = reply.get("result"), reply.get("failure")
    if (result is None) == (failure is None):
        raise _refused("exactly one of result or failure is required", reply)
    if failure is not None:
        return _failure_record(task_id, failure, reply)
    if not isinstance(result, dict):
        raise _refused(
            f"environment server reply for task {task_id!r} carries a non-object result: "
            f"{result!r}"[:2000],
            reply,
        )
    reserved = sorted(k for k in result if k.startswith("_ng_") or k in COLLECTOR_KEYS)
    if reserved:
        raise _refused(
            f"environment server result for task {task_id!r} uses keys reserved for rollout "
            f"collection: {reserved}",
            reply,
        )
    return {**result, F.NG_TASK_ID: task_id}


def _failure_record(task_id: Any, failure: Any, reply: dict[str, Any]) -> dict[str, Any]:
    """A handled episode failure as NeMo Gym records it: `environment_server_failed`."""
    if not isinstance(failure, dict):
        raise _refused(
            f"environment server reply for task {task_id!r} carries a non-object failure: "
            f"{failure!r}"[:2000],
            reply,
        )
    record: dict[str, Any] = {
        F.NG_TASK_ID: task_id,
        F.FAILURE_CLASS: ENVIRONMENT_FAILURE_CLASS,
        F.FAILURE_TERMINAL: bool(failure.get("terminal", False)),
        F.FAILURE_MESSAGE: failure.get("failure_reason"),
    }
    if failure.get("stage") is not None:
        record["_ng_failure_stage"] = failure["stage"]
    if failure.get("partial_response") is not None:
        record["_ng_failure_partial_response"] = failure["partial_response"]
    if isinstance(failure.get("failure_kind"), str):
        record[F.FAILURE_KIND] = failure["failure_kind"]
    return record
