"""Summary states at the end of a run: disabled, provisional (from Redis), and a check that fails."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from unittest.mock import Mock

import fakeredis
import pytest

from infra import keys
from infra.store import RunDir
from schemas import fields as F
from schemas.coverage import RunCoverage
from schemas.health import Limits
from schemas.records import Generation, utc_now
from schemas.settings import CollectionSettings
from tests.health_fixtures import failure, read_summary, record, write_lines
from workers import finish
from workers.health.provisional import write_provisional
from workers.health.sources import source_for
from workers.shard.coverage import write_coverage
from workers.shard.reservations import Reservations, encode_keys


def shard_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    write_lines(folder / "rollouts-0.jsonl", [record(0, 0), record(0, 1)])
    return folder


def test_disabled_setting_writes_the_disabled_summary(tmp_path: Path) -> None:
    folder = shard_folder(tmp_path)
    brief = finish.check_shard_health(
        RunDir(str(folder)),
        "0",
        CollectionSettings(disable_health_check=True, max_failed_rollouts=3),
    )
    assert "error" not in brief
    assert brief["state"] == "disabled" and brief["healthy"] is None
    run = read_summary(folder)["run"]
    assert run["state"] == "disabled"
    assert run["limits"]["max_failed_rollouts"] == 3
    assert run["sources"] == ["rollouts-0.jsonl"]


def test_a_failing_check_is_logged_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(finish, "check_sources_here", Mock(side_effect=OSError("disk on fire")))
    brief = finish.check_shard_health(
        RunDir(str(shard_folder(tmp_path))), "0", CollectionSettings()
    )
    assert "error" in brief and brief["error"] == "OSError: disk on fire"
    assert "health check of" in caplog.text


def test_provisional_summary_from_redis_and_the_sidecar(tmp_path: Path) -> None:
    folder = shard_folder(tmp_path)
    write_lines(
        folder / "rollouts-0_failures.jsonl",
        [
            failure(0, 1, "agent_request_failed"),  # later landed: not failed
            failure(1, 0, "agent_request_failed"),
            failure(1, 0, "agent_run_error"),  # latest stands
            failure(1, 1, "agent_run_error"),
        ],
    )
    rd = RunDir(str(folder))
    r = fakeredis.FakeRedis()
    sid = keys.shard_id(rd.url, "0")
    r.hset(keys.shard_state(sid), mapping={"built": "1", "opener": "t"})
    r.sadd(keys.shard_landed(sid), "0:0", "0:1")
    r.hset(keys.shard_counts(sid), mapping={"landed": 2, "drained": 1, "failed:agent_run_error": 2})

    run = write_provisional(
        rd,
        "0",
        r,
        planned=10,
        group_owed=Counter({("math_agent", "math_env"): 10}),
        limits=Limits(max_failed_rollouts=2),
        ignored=[],
    )

    assert read_summary(folder)["run"] == run
    acc = run["accounting"]
    assert (acc["owed"], acc["landed"], acc["drained"]) == (10, 2, 1)
    assert acc["failed"] == {"total": 2, "by_class": {"agent_run_error": 2}}
    assert acc["missing"] == 10 - 2 - 2 - 1
    assert acc["scored"] is None and acc["duplicates"] is None
    [finding] = acc["run_excessive_failures"]["findings"]
    assert finding["detail"]["failed"] == 2 and finding["detail"]["owed"] == 10
    assert run["state"] == "provisional"
    assert run["healthy"] is False  # a limit is already reached: no need to read the records
    assert run["verdicts"] == {"healthy": None, "unhealthy": None, "unobserved": None}

    # Stopped while enqueueing: the per-group counts are unknown, so the check cannot judge.
    run = write_provisional(
        rd, "0", r, planned=10, group_owed=None, limits=Limits(max_failed_rollouts=2), ignored=[]
    )
    assert run["accounting"]["run_excessive_failures"]["coverage"] == "unobserved"
    assert run["accounting"]["owed"] == 10
    assert run["healthy"] is None
    assert run["reasons"][0].startswith("provisional")


def test_the_provisional_accounting_has_the_shards_rate_limit_waits(tmp_path: Path) -> None:
    rd = RunDir(str(shard_folder(tmp_path)))
    r = fakeredis.FakeRedis()
    sid = keys.shard_id(rd.url, "0")
    r.hset(keys.shard_state(sid), mapping={"built": "1", "opener": "t"})
    r.hset(
        keys.shard_counts(sid),
        mapping={"rate_limit_waits:math_agent": 4, "rate_limit_wait_ms:math_agent": 4250},
    )
    run = write_provisional(rd, "0", r, planned=10, group_owed=None, limits=Limits(), ignored=[])
    assert run["accounting"]["rate_limit_waits"] == {"math_agent": {"count": 4, "seconds": 4.25}}


def test_the_provisional_accounting_selects_failures_as_the_coverage_does(tmp_path: Path) -> None:
    """A resume stopped before its attempt of a rollout wrote: the rollout's older failure no
    longer stands (it is missing, as in the coverage), while one the resume did not dispatch
    again still does; the summary points at the shard's coverage record."""
    folder = shard_folder(tmp_path)
    old = {F.EXECUTION: {"generation": 0, "attempt": 1}}
    write_lines(
        folder / "rollouts-0_failures.jsonl",
        [{**failure(1, 0, "agent_run_error"), **old}, {**failure(1, 1, "agent_run_error"), **old}],
    )
    rd = RunDir(str(folder))
    r = fakeredis.FakeRedis()
    sid = keys.shard_id(rd.url, "0")
    r.hset(keys.shard_state(sid), mapping={"built": "1", "opener": "t"})
    r.sadd(keys.shard_landed(sid), "0:0", "0:1")
    generations = [
        Generation(token="a", kind="run", started_at=utc_now(), enqueued=4),
        Generation(token="b", kind="resume", started_at=utc_now(), enqueued=1,
                   reserved=encode_keys([(1, 0)])),
    ]  # fmt: skip
    coverage = RunCoverage(
        run_id="r", shard="0", expected=4, successful=2, measured=2, masked=0, unscored=0,
        failed=1, intentionally_omitted=0, unknown=1, complete=False, reconciled=False, scored=2,
        counted_failures=0, attempts_exhausted=0, max_rollout_attempts=3, attempts=4,
        identity_verified=True, written_by="stop",
    )  # fmt: skip
    write_coverage(rd, coverage)
    run = write_provisional(
        rd, "0", r, planned=4, group_owed=None, limits=Limits(), ignored=[],
        reserved=Reservations(generations),
        coverage_of=[source_for(rd, "rollouts-0.jsonl", "rollouts-0.jsonl")],
    )  # fmt: skip
    acc = run["accounting"]
    assert acc["failed"] == {"total": 1, "by_class": {"agent_run_error": 1}}
    assert acc["missing"] == 1  # (1, 0): dispatched again, no outcome of the resume yet
    assert run["coverage"] is not None and run["coverage"]["complete"] is False
    assert run["coverage"]["files"] == [
        {"source": "rollouts-0.jsonl", "path": "rollouts-0_coverage.json", "complete": False,
         "written_by": "stop", "updated_at": coverage.updated_at},
    ]  # fmt: skip
