"""Score imputation (`count_failure_classes_as_zero`, `count_missing_rollouts_as_zero`), no servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from infra.store import RunDir, ShardFiles
from producer.shard.plan import plan_resume, rows_to_run
from schemas.config import ServersConfig
from schemas.finish import Coverage, FinishResult
from schemas.settings import CollectionSettings
from workers.shard.coverage import RecoveryPolicy
from workers.shard.ledger import count_shard
from workers.shard.scored import ScoredRows, counted_failure, missing_zero

FILES = ShardFiles("0")
CONFIG = ServersConfig.model_validate(
    {"agents": {"a": {"url": "http://a", "environment": "e"}}, "environments": {"e": {"url": "x"}}}
)


def planned(task: int, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "a"},
        "responses_create_params": {"input": "q"},
        "subset": f"s{task}",
        "weight": 2,
        "_ng_run_id": "r",
        **extra,
    }


def result(task: int, reward: float) -> dict[str, Any]:
    row = {**planned(task), "reward": reward, "_ng_environment_server": "e"}
    del row["weight"]  # a dataset field no result carries is not given to an added row
    return row


def fail(task: int, cls: str, **extra: Any) -> dict[str, Any]:
    return {
        **planned(task),
        "_ng_failure_class": cls,
        "_ng_failure_message": "boom",
        "_ng_failure_http_status": 500,
        "failure_kind": "agent_run_error",
        **extra,
    }


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


@pytest.fixture
def shard(tmp_path: Path) -> RunDir:
    """Eight planned: 0, 1 landed; 2 judge_failed; 3 judge_failed then agent_run_error;
    4 agent_run_error then judge_failed; 5 judge_failed, then landed; 6, 7 left no row."""
    write(tmp_path / FILES.materialized, [planned(i) for i in range(7)] + [{"x": 1, **_key(7)}])
    write(tmp_path / FILES.results, [result(0, 1.0), result(1, 0.0), result(5, 1.0)])
    write(
        tmp_path / FILES.failures,
        [
            fail(2, "judge_failed", reward=0.5),
            fail(3, "judge_failed"),
            fail(3, "agent_run_error"),
            fail(4, "agent_run_error"),
            fail(4, "judge_failed"),
            fail(5, "judge_failed"),
        ],
    )
    return RunDir(str(tmp_path))


def _key(task: int) -> dict[str, Any]:
    return {"_ng_task_index": task, "_ng_rollout_index": 0}


def scored(rd: RunDir, **settings: Any) -> tuple[list[dict[str, Any]], Coverage]:
    rows = ScoredRows.of(rd, count_shard(rd, "0"), CONFIG, CollectionSettings(**settings))
    out = list(rows)
    return out, rows.coverage()


def test_a_counted_failure_drops_its_diagnostics_and_scores_zero_unless_rewarded() -> None:
    row = counted_failure(fail(2, "judge_failed"))
    assert not any(k.startswith("_ng_failure_") for k in row) and "failure_kind" not in row
    assert row["reward"] == 0.0 and row["mask_sample"] is False and row["subset"] == "s2"
    assert counted_failure(fail(2, "judge_failed", reward=0.5))["reward"] == 0.5


def test_a_missing_zero_carries_only_the_identity() -> None:
    assert missing_zero(planned(6, _ng_environment_server="e")) == {
        "_ng_task_index": 6,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "a"},
        "reward": 0.0,
        "_ng_environment_server": "e",
    }
    assert missing_zero({"_ng_task_index": 1, "_ng_rollout_index": 0}) is None


def test_without_imputation_the_metrics_score_the_results_only(shard: RunDir) -> None:
    rows, coverage = scored(shard)
    assert [r["_ng_task_index"] for r in rows] == [0, 1, 5]
    assert (coverage.expected, coverage.scored, coverage.imputed) == (8, 3, 0)
    assert coverage.dropped == {"agent_run_error": 1, "judge_failed": 2}
    assert coverage.lines() == [
        "Rollouts missing from the score: 5 of 8 materialized (1 agent_run_error, "
        f"2 judge_failed routed this run; see {shard.path(FILES.failures)})",
        "Metrics cover: 3 of 8 rollouts",
    ]


def test_failure_classes_count_the_latest_failure_of_rollouts_without_a_result(
    shard: RunDir,
) -> None:
    rows, coverage = scored(shard, count_failure_classes_as_zero=["judge_failed"])
    added = {r["_ng_task_index"]: r for r in rows[3:]}
    assert sorted(added) == [2, 4]  # 3's latest failure is another class; 5 landed
    assert added[2]["reward"] == 0.5 and added[4]["reward"] == 0.0
    assert all(r["mask_sample"] is False for r in added.values())
    assert (coverage.scored, coverage.failures_counted_as_zero, coverage.imputed) == (5, 2, 0)
    assert coverage.dropped == {"agent_run_error": 1}


def test_missing_rollouts_score_zero_with_the_dataset_fields_results_carry(shard: RunDir) -> None:
    rows, coverage = scored(shard, count_missing_rollouts_as_zero=True)
    added = rows[3:]
    assert [r["_ng_task_index"] for r in added] == [6]  # 7 names no agent nor server
    assert added[0] == {
        "_ng_task_index": 6,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "a"},
        "reward": 0.0,
        "subset": "s6",  # carried by the results of its server; `weight` is not, `_ng_*` never
    }
    assert (coverage.scored, coverage.imputed) == (4, 1)
    assert coverage.lines()[-1] == "Scored as zero because they left no row: 1 of 8 rollouts"


def test_both_settings_together_never_count_a_rollout_twice(shard: RunDir) -> None:
    rows, coverage = scored(
        shard, count_failure_classes_as_zero=["judge_failed"], count_missing_rollouts_as_zero=True
    )
    keys = [r["_ng_task_index"] for r in rows]
    assert sorted(keys) == [0, 1, 2, 4, 5, 6] and len(set(keys)) == len(keys)
    assert coverage.model_dump() == {
        "expected": 8,
        "scored": 6,
        "failures_counted_as_zero": 2,
        "imputed": 1,
        "dropped": {"agent_run_error": 1},
        "failures_path": shard.path(FILES.failures),
    }


def test_a_complete_run_has_no_coverage_lines() -> None:
    assert Coverage(expected=3, scored=3).lines() == []


def test_resume_does_not_run_a_rollout_settled_as_a_scored_zero(shard: RunDir) -> None:
    write_manifest_of(shard)
    plan = plan_resume(shard, "0", RecoveryPolicy(3, frozenset({"judge_failed"})))
    assert (plan.coverage.successful, plan.coverage.counted_failures, plan.to_run) == (3, 2, 3)
    assert plan.coverage.states["model_final"] == 2
    assert [r["_ng_task_index"] for r in rows_to_run(shard, "0", plan)] == [3, 6, 7]
    plan = plan_resume(shard, "0", RecoveryPolicy(3))
    assert (plan.coverage.counted_failures, plan.to_run) == (0, 5)


def write_manifest_of(shard: RunDir) -> None:
    import hashlib

    from infra.runs import write_manifest
    from schemas.records import Generation, InputSource, Manifest, utc_now

    data = shard.read_bytes(FILES.materialized)
    write_manifest(
        shard,
        Manifest(
            run_id="r", shard="0", created_at=utc_now(), input=InputSource(path="x", sha256="0"),
            config={}, settings={}, planned=8, materialized_sha256=hashlib.sha256(data).hexdigest(),
            generations=[Generation(token="t0", kind="run", started_at=utc_now(), enqueued=8)],
        ),
    )  # fmt: skip


def test_the_finish_result_round_trips_through_json() -> None:
    result = FinishResult(
        state="completed", landed=3, planned=4, coverage=Coverage(expected=4, scored=4, imputed=1)
    )
    data = orjson.loads(orjson.dumps(result.model_dump(mode="json")))
    assert FinishResult.model_validate(data) == result
    assert FinishResult.model_validate({"state": "superseded"}).landed is None
