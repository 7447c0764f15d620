"""A materialized task row's `/run`: NeMo Gym's episode body, and how its reply lands (issue 38)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from schemas import fields as F
from schemas.messages import CallPolicy
from workers.rollout.agent_call import CallOutcome, call_run
from workers.rollout.rows import sort_outcome

TASK = {"taskset": "harbor:tb", "task_id": "7"}
ROW = {
    "task_id": TASK, "task_input": {"cmd": "ls"}, "_ng_task_index": 3, "_ng_rollout_index": 1,
    "_ng_environment_server": "harbor_env", "_ng_run_id": "r", "_ng_shard": "0",
}  # fmt: skip


def run(
    reply: Callable[[dict[str, Any]], Any], row: dict[str, Any] | None = None, **policy: Any
) -> tuple[CallOutcome, list[dict[str, Any]]]:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json=reply(body))

    async def go() -> CallOutcome:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            return await call_run(client, "http://env", dict(row or ROW), CallPolicy(**policy))
        finally:
            await client.aclose()

    return asyncio.run(go()), bodies


def answered(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda body: {"episode_id": body["episode_id"], "task_id": body["task"]["task_id"],
                         **fields}  # fmt: skip


def test_the_episode_body_is_nemo_gyms() -> None:
    _, bodies = run(answered(result={"reward": 1.0}))
    assert bodies == [
        {"episode_id": {"rollout_id": "3-1", "attempt": 0},
         "task": {"task_id": TASK, "task_input": {"cmd": "ls"}}}
    ]  # fmt: skip
    # A later attempt keeps the rollout id and says the attempt apart (its capture key: 3-1-a2).
    _, bodies = run(answered(result={}), {**ROW, F.ATTEMPT_INDEX: 2})
    assert bodies[0]["episode_id"] == {"rollout_id": "3-1", "attempt": 2}
    _, bodies = run(answered(result={}), {**ROW, F.ROLLOUT_ID: "tb-7", F.ATTEMPT_INDEX: 1})
    assert bodies[0]["episode_id"] == {"rollout_id": "tb-7", "attempt": 1}


def test_a_result_lands_as_returned_with_the_task_id_and_the_planned_identity() -> None:
    outcome, _ = run(answered(result={"reward": 0.5, "response": {"id": "x"}, "notes": [1]}))
    result, failures, _ = sort_outcome(outcome)
    assert failures == [] and result is not None
    assert result == {
        "reward": 0.5, "response": {"id": "x"}, "notes": [1], F.NG_TASK_ID: TASK,
        **{k: ROW[k] for k in F.IDENTITY_FIELDS if k in ROW},
    }  # fmt: skip


def test_a_handled_failure_is_an_environment_server_failed_row() -> None:
    failure = {"failure_reason": "sandbox lost", "terminal": True, "stage": "seed",
               "failure_kind": "session_lost", "partial_response": {"step": 3}}  # fmt: skip
    outcome, _ = run(answered(failure=failure))
    result, failures, _ = sort_outcome(outcome)
    assert result is None
    assert failures == [
        {
            F.NG_TASK_ID: TASK, F.FAILURE_CLASS: "environment_server_failed",
            F.FAILURE_TERMINAL: True, F.FAILURE_MESSAGE: "sandbox lost",
            "_ng_failure_stage": "seed", "_ng_failure_partial_response": {"step": 3},
            F.FAILURE_KIND: "session_lost",
            **{k: ROW[k] for k in F.IDENTITY_FIELDS if k in ROW},
        }
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (lambda b: {"reward": 1.0}, "is not an episode response"),
        (answered(result={"reward": 1}, failure={"failure_reason": "x", "terminal": False}),
         "exactly one of result or failure is required"),
        (lambda b: {**answered(result={})(b), "task_id": {"taskset": "x", "task_id": "1"}},
         "the episode response names task"),
        (lambda b: {**answered(result={})(b), "episode_id": {"rollout_id": "9-9", "attempt": 0}},
         "the episode response names episode"),
        (answered(result=[1]), "carries a non-object result"),
        (answered(result={"reward": 1, "_ng_task_index": 5, "ng_perf": {}}),
         "uses keys reserved for rollout collection: ['_ng_task_index', 'ng_perf']"),
    ],
)  # fmt: skip
def test_a_reply_that_is_no_episode_response_fails_the_attempt(
    reply: Callable[[dict[str, Any]], Any], message: str
) -> None:
    outcome, bodies = run(reply, max_attempts=3)
    assert len(bodies) == 1  # not replayed: the server answered, wrongly
    assert outcome.result is None and outcome.final_failure is not None
    failure = outcome.final_failure
    assert failure[F.FAILURE_CLASS] == "agent_request_failed"
    assert failure[F.FAILURE_TYPE] == "InvalidEpisodeReply"
    assert message in failure[F.FAILURE_MESSAGE]
    assert failure[F.NG_TASK_ID] == TASK and failure[F.TASK_INDEX] == 3
