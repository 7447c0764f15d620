"""What the example environment server computes from verified rollouts.

Per task and over all rollouts: mean, max, min, median and sample std of every numeric field
(booleans as 0/1, `response.usage` merged in), and pass@k for binary rewards with the unbiased
estimator 1 - C(n - c, k) / C(n, k), as percentages.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any

INDEX_FIELDS = ("_ng_task_index", "_ng_rollout_index")


def numeric_fields(row: dict[str, Any]) -> dict[str, float]:
    flat: dict[str, Any] = dict(row)
    response = row.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        flat.update(response["usage"])
    out: dict[str, float] = {}
    for key, value in flat.items():
        if key in INDEX_FIELDS or key.startswith("_"):
            continue
        if isinstance(value, bool) or (isinstance(value, int | float) and math.isfinite(value)):
            out[key] = float(value)
    return out


def describe(columns: dict[str, list[float]]) -> dict[str, float]:
    stats: dict[str, float] = {}
    for name in sorted(columns):
        values = columns[name]
        if not values:
            continue
        stats[f"mean/{name}"] = statistics.fmean(values)
        stats[f"max/{name}"] = max(values)
        stats[f"min/{name}"] = min(values)
        stats[f"median/{name}"] = statistics.median(values)
        stats[f"std/{name}"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return stats


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for n samples of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_binary(rewards: list[float]) -> bool:
    return all(r in (0.0, 1.0) for r in rewards)


def pass_metrics(tasks: dict[Any, list[float]]) -> dict[str, float]:
    """pass@k for k = 1..min repeats, and pass@1[avg-of-k], over tasks, in percent."""
    if not tasks:
        return {}
    max_k = min(len(v) for v in tasks.values())
    binary = all(is_binary(v) for v in tasks.values())
    out: dict[str, float] = {}
    for k in range(1, max_k + 1):
        if binary:
            scores = [pass_at_k(len(v), int(sum(v)), k) for v in tasks.values()]
        else:
            scores = [max(v[:k]) for v in tasks.values()]
        out[f"pass@{k}/accuracy"] = 100.0 * statistics.fmean(scores)
    out[f"pass@1[avg-of-{max_k}]/accuracy"] = 100.0 * statistics.fmean(
        statistics.fmean(v[:max_k]) for v in tasks.values()
    )
    return out


def aggregate_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The `/aggregate_metrics` answer for `rows`."""
    if not rows:
        return {"group_level_metrics": [], "agent_metrics": {}, "key_metrics": {}}
    by_task: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_task[row.get("_ng_task_index", 0)].append(row)
    groups = []
    rewards_by_task: dict[Any, list[float]] = {}
    for task in sorted(by_task, key=lambda t: (isinstance(t, str), t)):
        members = sorted(by_task[task], key=lambda r: r.get("_ng_rollout_index", 0))
        columns: dict[str, list[float]] = defaultdict(list)
        for row in members:
            for name, value in numeric_fields(row).items():
                columns[name].append(value)
        rewards = [float(r["reward"]) for r in members if isinstance(r.get("reward"), int | float)]
        if rewards:
            rewards_by_task[task] = rewards
        group = {"_ng_task_index": task, "num_rollouts": len(members), **describe(columns)}
        if rewards:
            group.update(pass_metrics({task: rewards}))
        groups.append(group)
    overall: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for name, value in numeric_fields(row).items():
            overall[name].append(value)
    agent_metrics = describe(overall)
    agent_metrics.update(pass_metrics(rewards_by_task))
    agent_metrics["num_rollouts"] = len(rows)
    agent_metrics["num_tasks"] = len(by_task)
    key_metrics = {k: v for k, v in agent_metrics.items() if k.startswith(("mean/reward", "pass@"))}
    return {
        "group_level_metrics": groups,
        "agent_metrics": agent_metrics,
        "key_metrics": key_metrics,
        "repeat_level_metrics": repeat_metrics(rows),
    }


def repeat_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rollout index (the k-th repeat of every task), as NeMo Gym's servers report."""
    by_repeat: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: Counter[Any] = Counter()
    for row in rows:
        index = row.get("_ng_rollout_index", 0)
        counts[index] += 1
        for name, value in numeric_fields(row).items():
            by_repeat[index][name].append(value)
    return [
        {"_ng_rollout_index": index, "num_rollouts": counts[index], **describe(by_repeat[index])}
        for index in sorted(counts, key=lambda i: (isinstance(i, str), i))
    ]
