"""The example environment's statistics and pass@k."""

from __future__ import annotations

import math
from typing import Any

import pytest

from examples.metrics import aggregate_metrics, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 4, 2, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 2, 2, 1 - 1 / 6),
        (5, 3, 3, 1.0),
    ],
)
def test_unbiased_pass_at_k(n: int, c: int, k: int, expected: float) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected)


def test_aggregate_per_task_and_overall() -> None:
    rows: list[dict[str, Any]] = [
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 0,
            "reward": 1.0,
            "response": {"usage": {"output_tokens": 4}},
        },
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 1,
            "reward": 0.0,
            "response": {"usage": {"output_tokens": 6}},
        },
        {"_ng_task_index": 1, "_ng_rollout_index": 0, "reward": 0.0, "flag": True},
        {"_ng_task_index": 1, "_ng_rollout_index": 1, "reward": 0.0, "flag": False},
    ]
    out = aggregate_metrics(rows)
    overall = out["agent_metrics"]
    assert overall["mean/reward"] == 0.25
    assert overall["max/output_tokens"] == 6 and overall["min/output_tokens"] == 4
    assert math.isclose(overall["std/reward"], 0.5)
    assert overall["median/flag"] == 0.5
    assert overall["pass@1/accuracy"] == 25.0
    assert overall["pass@2/accuracy"] == 50.0
    assert overall["pass@1[avg-of-2]/accuracy"] == 25.0
    groups = out["group_level_metrics"]
    assert [g["_ng_task_index"] for g in groups] == [0, 1]
    assert groups[0]["mean/reward"] == 0.5 and groups[0]["pass@2/accuracy"] == 100.0
    assert groups[1]["num_rollouts"] == 2 and groups[1]["std/reward"] == 0.0
    assert set(out["key_metrics"]) <= set(overall)
    assert "mean/reward" in out["key_metrics"]


def test_empty_input() -> None:
    assert aggregate_metrics([]) == {
        "group_level_metrics": [],
        "agent_metrics": {},
        "key_metrics": {},
    }
