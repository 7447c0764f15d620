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


def test_float_statistics_agree_with_the_standard_library() -> None:
    """The answer's float arithmetic gives what `statistics` gives exactly, to the last digits;
    a constant column keeps its value whole."""
    import random
    import statistics

    rng = random.Random(7)
    rows: list[dict[str, Any]] = [
        {
            "_ng_task_index": i // 5,
            "_ng_rollout_index": i % 5,
            "reward": float(rng.random() < 0.4),
            "score": rng.gauss(3.0, 2.0),
            "fixed": 0.1,
            "response": {"usage": {"output_tokens": rng.randint(1, 500)}},
        }
        for i in range(200)
    ]
    out = aggregate_metrics(rows)
    for name in ("reward", "score", "output_tokens"):
        column = [float(r[name] if name in r else r["response"]["usage"][name]) for r in rows]
        overall = out["agent_metrics"]
        assert math.isclose(overall[f"mean/{name}"], statistics.fmean(column), rel_tol=1e-12)
        assert math.isclose(overall[f"std/{name}"], statistics.stdev(column), rel_tol=1e-12)
        assert overall[f"median/{name}"] == statistics.median(column)
        for group in out["group_level_metrics"]:
            members = column[group["_ng_task_index"] * 5 :][:5]
            assert math.isclose(group[f"std/{name}"], statistics.stdev(members), rel_tol=1e-12)
    assert out["agent_metrics"]["mean/fixed"] == 0.1
    assert out["agent_metrics"]["std/fixed"] == 0.0
    repeats = out["repeat_level_metrics"]
    assert [r["_ng_rollout_index"] for r in repeats] == [0, 1, 2, 3, 4]
    assert all(r["num_rollouts"] == 40 for r in repeats)
