"""A worker's rollout requests share their run-wide parts, and validate as `model_validate` does."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from schemas.messages import CallPolicy, CollectRequest, SharedParts
from schemas.replies import ReplyingCollectRequest

PAYLOAD: dict[str, Any] = {
    "run": {"run_id": "run-1", "output_dir": "/tmp/x", "shard": "0", "token": "t" * 32},
    "agent_url": "http://agent",
    "policy": {"timeout_s": 60.0, "max_attempts": 2},
    "row": {"_ng_task_index": 0, "_ng_rollout_index": 0},
    "admission": {"agent_max_concurrency": 4},
    "health": {"ignored": ["empty_output"]},
}


def decoded(payload: dict[str, Any], **row: Any) -> dict[str, Any]:
    """The payload as a worker decodes it from its message: new objects every time."""
    out: dict[str, Any] = orjson.loads(orjson.dumps(payload))
    out["row"].update(row)
    return out


def test_requests_of_one_generation_share_their_parts_and_equal_a_plain_validation() -> None:
    parts = SharedParts()
    a = parts.validate(CollectRequest, decoded(PAYLOAD, _ng_task_index=1))
    b = parts.validate(CollectRequest, decoded(PAYLOAD, _ng_task_index=2))
    assert a == CollectRequest.model_validate(decoded(PAYLOAD, _ng_task_index=1))
    assert (a.run, a.policy, a.admission, a.health) == (b.run, b.policy, b.admission, b.health)
    assert a.run is b.run and a.policy is b.policy and a.admission is b.admission
    assert a.health is b.health and a.row is not b.row
    assert (a.row["_ng_task_index"], b.row["_ng_task_index"]) == (1, 2)


def test_the_payloads_share_one_decoded_copy_of_each_part_equal_to_their_own() -> None:
    parts = SharedParts()
    first, second = decoded(PAYLOAD, _ng_task_index=1), decoded(PAYLOAD, _ng_task_index=2)
    before = copy.deepcopy(second)
    parts.validate(CollectRequest, first)
    parts.validate(CollectRequest, second)
    assert second == before  # what Celery shows of the delivery is unchanged
    for name in ("run", "policy", "admission", "health"):
        assert second[name] is first[name]
    assert second["row"] is not first["row"]
    bad = decoded(PAYLOAD)
    bad["agent_url"] = 7
    with pytest.raises(ValidationError):
        parts.validate(CollectRequest, bad)
    assert bad["policy"] is not first["policy"]  # a payload that fails is left as it came


def test_a_part_that_differs_is_its_own() -> None:
    parts = SharedParts()
    other = decoded(PAYLOAD)
    other["policy"]["timeout_s"] = 30.0
    a, b = parts.validate(CollectRequest, decoded(PAYLOAD)), parts.validate(CollectRequest, other)
    assert a.run is b.run and a.policy is not b.policy
    assert (a.policy.timeout_s, b.policy.timeout_s) == (60.0, 30.0)


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p["policy"].update(timeout_s="soon"),  # a shared part that fails
        lambda p: p["run"].pop("token"),
        lambda p: p.update(extra_field=1),  # the request itself
        lambda p: p.update(policy=["not", "an", "object"]),
        lambda p: p.pop("row"),
    ],
)
def test_a_bad_payload_fails_with_the_errors_of_a_plain_validation(change: Any) -> None:
    parts = SharedParts()
    parts.validate(CollectRequest, decoded(PAYLOAD))  # its good parts validated before
    bad = decoded(PAYLOAD)
    change(bad)
    with pytest.raises(ValidationError) as plain:
        CollectRequest.model_validate(copy.deepcopy(bad))
    with pytest.raises(ValidationError) as shared:
        parts.validate(CollectRequest, bad)
    assert shared.value.errors() == plain.value.errors()


def test_a_subclass_validates_its_own_fields_too() -> None:
    parts = SharedParts()
    plain = parts.validate(CollectRequest, decoded(PAYLOAD))
    payload = {**decoded(PAYLOAD), "reply": {"invocation": "i", "index": 3}}
    replying = parts.validate(ReplyingCollectRequest, payload)
    assert isinstance(replying, ReplyingCollectRequest) and replying.reply.index == 3
    assert replying.policy is plain.policy
    with pytest.raises(ValidationError):
        parts.validate(ReplyingCollectRequest, decoded(PAYLOAD))  # no reply


def test_the_parts_kept_are_bounded() -> None:
    parts = SharedParts(most=3)
    policies = []
    for timeout in range(10):
        payload = decoded(PAYLOAD)
        payload["policy"]["timeout_s"] = float(timeout + 1)
        policies.append(parts.validate(CollectRequest, payload).policy)
    assert len(parts._parts) <= 3
    assert [p.timeout_s for p in policies] == [float(t + 1) for t in range(10)]
    assert all(isinstance(p, CallPolicy) for p in policies)


def test_parts_built_in_process_are_validated_as_given() -> None:
    payload = {**decoded(PAYLOAD), "policy": {"timeout_s": 5.0, "max_attempts": object()}}
    with pytest.raises(ValidationError):
        SharedParts().validate(CollectRequest, payload)
