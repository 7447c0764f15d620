"""Resume planning, NeMo Gym path spelling, status tallies and who holds what: plain functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from infra.store import RunDir
from producer.cli.nemo_gym import nemo_gym_output
from producer.ops.status import FileTally, add_holders, coverage_text, exit_code, holders_lines
from producer.shard.live import LiveSnapshot, RunningRollout
from producer.shard.plan import plan_resume, rows_to_run, states_by_key
from producer.shard.resume import max_attempts_limit
from schemas.config import redact_url
from schemas.errors import UsageError
from schemas.settings import CollectionSettings
from workers.shard.coverage import RecoveryPolicy


def write(path: Path, rows: list[dict[str, Any]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


def planned(n: int) -> list[dict[str, Any]]:
    return [
        {"_ng_task_index": i, "_ng_rollout_index": 0, "agent_ref": {"name": "a" if i % 2 else "b"},
         "_ng_environment_server": "env"}
        for i in range(n)
    ]  # fmt: skip


def fail(i: int, cls: str = "agent_run_error", attempt: int = 0, **extra: Any) -> dict[str, Any]:
    row = {**planned(i + 1)[i], "_ng_failure_class": cls, **extra}
    if attempt:
        row["_ng_attempt_index"] = attempt
    return row


@pytest.fixture
def shard(tmp_path: Path) -> RunDir:
    write(tmp_path / "rollouts-0_materialized_inputs.jsonl", planned(8))
    write(tmp_path / "rollouts-0.jsonl", [planned(8)[0], planned(8)[1], planned(8)[6]])
    write(
        tmp_path / "rollouts-0_failures.jsonl",
        [
            fail(1),  # failed, then landed
            fail(2),  # one failure: retried with attempt index 1
            fail(3), fail(3, attempt=1), fail(3, attempt=2),  # exhausted
            fail(4, "judge_failed", _ng_failure_terminal=True),  # terminal
            fail(5), fail(5, attempt=1),  # two failures: retried with attempt index 2
        ],
    )  # fmt: skip
    return RunDir(str(tmp_path))


def manifest_for(shard: RunDir, planned_n: int = 8) -> None:
    """A manifest of one fresh run over the shard's materialized inputs."""
    import hashlib

    from infra.runs import write_manifest
    from schemas.records import Generation, InputSource, Manifest, utc_now

    data = shard.read_bytes("rollouts-0_materialized_inputs.jsonl")
    write_manifest(
        shard,
        Manifest(
            run_id="r", shard="0", created_at=utc_now(), input=InputSource(path="x", sha256="0"),
            config={}, settings={}, planned=planned_n,
            materialized_sha256=hashlib.sha256(data).hexdigest(),
            generations=[Generation(token="t0", kind="run", started_at=utc_now(), enqueued=8)],
        ),
    )  # fmt: skip


def test_resume_runs_only_what_is_missing_and_stamps_attempts(shard: RunDir) -> None:
    manifest_for(shard)
    plan = plan_resume(shard, "0", RecoveryPolicy(3))
    states = plan.coverage.states
    assert (plan.coverage.expected, states["scored"], states["terminal"]) == (8, 3, 1)
    assert (states["judge_recoverable"], states["exhausted"], plan.to_run) == (0, 1, 3)
    # task 4's judge_failed row is terminal (and carries no answer to judge again)
    assert states_by_key(plan)["terminal"] == [(4, 0)] and states["retryable"] == 2
    assert states["missing"] == 1 and plan.coverage.identity_verified
    rows = list(rows_to_run(shard, "0", plan))
    assert [(r["_ng_task_index"], r.get("_ng_attempt_index")) for r in rows] == [
        (2, 1),
        (5, 2),
        (7, None),
    ]
    plan = plan_resume(shard, "0", RecoveryPolicy(2))
    assert (plan.coverage.states["exhausted"], plan.to_run) == (2, 2)


def test_recovery_states(shard: RunDir) -> None:
    manifest_for(shard)
    keys = states_by_key(plan_resume(shard, "0", RecoveryPolicy(3)))
    assert keys["scored"] == [(0, 0), (1, 0), (6, 0)]
    assert keys["exhausted"] == [(3, 0)]
    assert keys["missing"] == [(7, 0)]
    assert keys["retryable"] == [(2, 0), (5, 0)]


def test_attempt_limit_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    console = Console(file=open("/dev/null", "w"))  # noqa: SIM115
    settings = CollectionSettings(max_attempts=5)
    monkeypatch.delenv("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", raising=False)
    assert max_attempts_limit(None, settings, console) == 5
    monkeypatch.setenv("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", "2")
    assert max_attempts_limit(None, settings, console) == 2
    assert max_attempts_limit(4, settings, console) == 4
    monkeypatch.setenv("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS", "zero")
    assert max_attempts_limit(None, settings, console) == 3
    with pytest.raises(UsageError):
        max_attempts_limit(0, settings, console)
    console.file.close()


def test_nemo_gym_output_paths() -> None:
    assert nemo_gym_output("/runs/e1/rollouts-0.jsonl") == ("/runs/e1", "0")
    assert nemo_gym_output("s3://bucket/e1/rollouts-part.a.jsonl") == ("s3://bucket/e1", "part.a")
    with pytest.raises(UsageError, match=r"rollouts-<shard>\.jsonl"):
        nemo_gym_output("/runs/e1/output.jsonl")


def test_file_tally_counts_incrementally_and_matches_the_files(tmp_path: Path) -> None:
    rows = planned(6)
    write(tmp_path / "rollouts-0_materialized_inputs.jsonl", rows)
    write(tmp_path / "rollouts-0.jsonl", [rows[0]], tail=b'{"_ng_task_index": 1, "_ng_rol')
    write(tmp_path / "rollouts-0_failures.jsonl", [fail(2), fail(3, "agent_request_failed")])
    tally = FileTally(RunDir(str(tmp_path)), "0")
    tally.refresh()
    assert (tally.ledger.planned, len(tally.ledger.landed_keys), dict(tally.ledger.failed)) == (
        6, 1, {"agent_run_error": 1, "agent_request_failed": 1},
    )  # fmt: skip
    assert tally.by_agent["a"].planned == 3 and tally.by_agent["b"].planned == 3
    # The torn line is completed, rollout 2 lands after its failure, 3 fails again differently.
    with open(tmp_path / "rollouts-0.jsonl", "ab") as f:
        f.write(b'lout_index": 0, "agent_ref": {"name": "a"}, "_ng_environment_server": "env"}\n')
        f.write(orjson.dumps(rows[2]) + b"\n")
    with open(tmp_path / "rollouts-0_failures.jsonl", "ab") as f:
        f.write(orjson.dumps(fail(3, "worker_lost")) + b"\n")
    tally.refresh()
    assert sorted(tally.ledger.landed_keys) == [(0, 0), (1, 0), (2, 0)]
    assert dict(tally.ledger.failed) == {"worker_lost": 1}
    assert tally.ledger.failure_rows == 3
    assert dict(tally.by_env["env"].failed) == {"worker_lost": 1}
    assert tally.by_agent["b"].landed == 2 and tally.by_agent["a"].landed == 1


def test_redact_url() -> None:
    assert redact_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://user:pw@host/1") == "redis://user:***@host/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_nemo_gym_spelling_resumes_only_a_shard_that_exists(tmp_path: Path) -> None:
    from producer.cli.nemo_gym import nemo_gym_spelling

    out = tmp_path / "eval"
    settings = {
        "input_jsonl_fpath": str(out / "rollouts-a_materialized_inputs.jsonl"),
        "output_jsonl_fpath": str(out / "rollouts-a.jsonl"),
        "resume_from_cache": True,
        "num_repeats": 2,
    }
    spelled = nemo_gym_spelling(dict(settings), None, None, None)
    assert spelled == (settings["input_jsonl_fpath"], str(out), "a", False)  # nothing to resume yet
    out.mkdir()
    (out / "rollouts-a_manifest.json").write_text("{}")
    (out / "rollouts-a_materialized_inputs.jsonl").write_text("")
    rest = dict(settings)
    assert nemo_gym_spelling(rest, None, None, None)[2:] == ("a", True)
    assert rest == {"num_repeats": 2}  # the path keys are not run settings
    with pytest.raises(UsageError, match="different shards"):
        nemo_gym_spelling(dict(settings), None, None, "b")


def test_who_holds_what_by_holder_redispatched_and_oldest() -> None:
    def lease(key: str, holder: str, stage: str, **kw: Any) -> RunningRollout:
        fields: dict[str, Any] = dict(attempt=1, heartbeat_age_s=0.4, running_s=5.0, lost=(),
                                      expired=False)  # fmt: skip
        fields.update(kw)
        return RunningRollout(key=key, holder=holder, stage=stage, **fields)

    rollouts = [
        lease("1:0", "a:1", "calling", running_s=40.0, attempt=2, lost=("b:2",)),
        lease("2:0", "a:1", "landing"),
        lease("3:0", "b:2", "calling", heartbeat_age_s=9.0, expired=True),
        lease("4:0", "c:3", "redispatched", lost=("b:2",)),
    ]
    report: dict[str, Any] = {}
    add_holders(report, rollouts)
    assert report["holders"] == {
        "a:1": {"rollouts": 2, "stages": {"calling": 1, "landing": 1}, "heartbeat_age_s": 0.4,
                "silent": False},
        "b:2": {"rollouts": 1, "stages": {"calling": 1}, "heartbeat_age_s": 9.0, "silent": True},
    }  # fmt: skip
    assert [x["key"] for x in report["redispatched"]] == ["1:0", "4:0"]
    assert report["oldest_in_flight"]["key"] == "1:0"
    assert len(report["rollouts_in_flight"]) == 4
    lines = holders_lines(report).strip().splitlines()
    assert lines == [
        "a:1: 2 (calling 1, landing 1) · heartbeat 0.4s ago",
        "b:2: 1 (calling 1) · SILENT 9.0s ago",
        "re-dispatched 2: 1:0, 4:0 · lost b:2",
        "oldest in flight 1:0 · calling 40s on a:1",
    ]
    assert all(len(line) <= 80 for line in lines)
    snap = LiveSnapshot(rollouts=rollouts)
    assert snap.silent_holders() == ["b:2"] and snap.active
    assert not LiveSnapshot(rollouts=[rollouts[2]]).active  # only an expired lease: not active
    assert exit_code({"state": "completed", "error": None}) == 0
    assert exit_code({"state": "completed", "error": "aggregation failed: x"}) == 1
    assert exit_code({"state": "cancelled", "error": "cancelled"}) == 1


def test_the_coverage_line_fits_80_columns_and_names_what_is_not_zero() -> None:
    coverage = dict(expected=480, measured=232, masked=0, unscored=0, failed=8,
                    intentionally_omitted=0, unknown=240, complete=False)  # fmt: skip
    assert coverage_text({"coverage": coverage}) == (
        "\ncoverage of 480: measured 232 · failed 8 · unknown 240"
    )
    big = dict(expected=1_000_000, measured=900_000, masked=20_000, unscored=0, failed=30_000,
               intentionally_omitted=50_000, unknown=0, complete=False)  # fmt: skip
    lines = coverage_text({"coverage": big}).strip().splitlines()
    assert lines == [
        "coverage of 1000000: measured 900000 · masked 20000 · failed 30000",
        "  omitted 50000 · unknown 0",
    ]
    assert all(len(line) <= 80 for line in lines)
    done = dict(big, masked=0, failed=0, intentionally_omitted=0, measured=1_000_000, complete=True)
    assert coverage_text({"coverage": done}).endswith("unknown 0 · complete")


def test_live_verdicts_never_exceed_the_landed_rows_read_with_them(
    shard: RunDir, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker appends its lines, then counts their verdicts in Redis. A result landing
    between status's two reads (whichever it makes first) must not be counted live but not
    landed."""
    import redis

    from infra import keys
    from producer.ops.status import StatusReader

    manifest_for(shard)
    r = redis.Redis.from_url(redis_url)
    sid = keys.shard_id(shard.url, "0")
    r.hset(keys.shard_health(sid), mapping={"healthy": 3})  # the three rows on file
    reader = StatusReader(shard, "0", redis_url)
    landed_between = False

    def land_one() -> None:  # what `workers/rollout/landing.py` does, in its order
        nonlocal landed_between
        if landed_between:
            return
        landed_between = True
        with open(Path(shard.path("rollouts-0.jsonl")), "ab") as f:
            f.write(orjson.dumps(planned(8)[7]) + b"\n")
        r.hincrby(keys.shard_health(sid), "healthy", 1)

    live, refresh = StatusReader.live, FileTally.refresh

    def live_then_land(self: StatusReader) -> Any:
        out = live(self)
        land_one()
        return out

    def refresh_then_land(self: FileTally) -> None:
        refresh(self)
        land_one()

    monkeypatch.setattr(StatusReader, "live", live_then_land)
    monkeypatch.setattr(FileTally, "refresh", refresh_then_land)
    report = reader.report()
    assert report["state"] not in ("completed", "failed") and report["live"]
    verdicts = report["health"]["live"]["verdicts"]
    assert sum(verdicts.values()) <= report["landed"], (verdicts, report["landed"])
    r.close()
