"""The shard ledger: one streaming fold of a shard's files, and the Redis state rebuilt from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from infra import keys
from infra.runs import write_manifest
from infra.store import RunDir, ShardFiles
from tests.shard_helpers import bare_manifest
from workers.shard import landed
from workers.shard.ledger import Failure, ShardLedger, count_shard
from workers.shard.state import BUILT, OPENER, RESULTS_SIZE, ShardState, read_state

FILES = ShardFiles("0")


def row(task: int, agent: str = "a", env: str = "e", **extra: Any) -> dict[str, Any]:
    return {
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": agent},
        "_ng_environment_server": env,
        **extra,
    }


def fail(task: int, cls: str, **extra: Any) -> dict[str, Any]:
    return row(task, _ng_failure_class=cls, **extra)


def lines(*rows: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


TORN = b'{"_ng_task_index": 7, "_ng_rol'


@pytest.fixture
def shard(tmp_path: Path) -> RunDir:
    """Eight planned rollouts; results with a duplicate, an unreadable line and a torn last line."""
    (tmp_path / FILES.materialized).write_bytes(
        lines(*(row(i, "a" if i % 2 else "b") for i in range(8)))
    )
    (tmp_path / FILES.results).write_bytes(
        lines(row(0, "b"), row(1))
        + b"not json\n"
        + lines(row(0, "b"), {"no": "key"}, row(6, "b"))
        + TORN
    )
    (tmp_path / FILES.failures).write_bytes(
        lines(
            fail(1, "agent_run_error"),  # failed, then landed
            fail(2, "agent_run_error"),
            fail(2, "worker_lost"),  # the latest failure stands
            fail(3, "judge_failed", _ng_failure_terminal=True),
            {"_ng_failure_class": "agent_run_error"},  # no key: a failure row all the same
            fail(5, "cancelled", _ng_no_persist=True, _ng_dispatch_drained=True),
            fail(4, "agent_request_failed", agent="x"),
        )
    )
    return RunDir(str(tmp_path))


def test_the_ledger_folds_results_failures_and_planned_rows(shard: RunDir) -> None:
    ledger = count_shard(shard, "0")
    assert ledger.planned == 8
    assert sorted(ledger.landed_keys) == [(0, 0), (1, 0), (6, 0)]
    assert ledger.landed == 3 and ledger.duplicates == 1
    assert dict(ledger.landed_by) == {("b", "e"): 2, ("a", "e"): 1}
    assert ledger.failure_rows == 6  # the drained row is no attempt
    assert ledger.drained == 1
    assert dict(ledger.failure_rows_by_class) == {
        "agent_run_error": 3,
        "worker_lost": 1,
        "judge_failed": 1,
        "agent_request_failed": 1,
    }
    assert dict(ledger.failed) == {"worker_lost": 1, "judge_failed": 1, "agent_request_failed": 1}
    assert ledger.failed_by[Failure("agent_request_failed", "x", "e")] == 1
    assert ledger.attempts[(2, 0)] == 2 and ledger.attempts[(1, 0)] == 1
    assert (5, 0) not in ledger.attempts
    assert ledger.terminal == {(3, 0)}
    assert ledger.latest[(1, 0)].cls == "agent_run_error"  # kept, though landed since
    assert ledger.settled_as_zero((2, 0), frozenset({"worker_lost"}))
    assert not ledger.settled_as_zero((1, 0), frozenset({"agent_run_error"}))  # it landed
    assert not ledger.settled_as_zero((3, 0), frozenset({"worker_lost"}))
    status = ledger.status("run", "0")
    assert (status.planned, status.landed, status.duplicates) == (8, 3, 1)
    assert status.failed == {"agent_request_failed": 1, "judge_failed": 1, "worker_lost": 1}


def test_the_ledger_stops_before_a_torn_line_and_reads_only_what_was_appended(
    shard: RunDir,
) -> None:
    ledger = ShardLedger.read(shard, "0")
    size = shard.size(FILES.results)
    assert ledger.offsets[FILES.results] == size - len(TORN)
    told: list[int] = []
    with open(shard.path(FILES.results), "ab") as f:
        f.write(b'lout_index": 0, "agent_ref": {"name": "a"}}\n')
    with open(shard.path(FILES.failures), "ab") as f:
        f.write(lines(fail(7, "agent_run_error"), fail(2, "agent_run_error")))
    ledger.refresh()
    assert (7, 0) in ledger.landed_keys
    assert dict(ledger.failed) == {
        "agent_run_error": 1,  # 2 failed again; 7 failed after it landed: not failed
        "judge_failed": 1,
        "agent_request_failed": 1,
    }
    assert ledger.attempts[(7, 0)] == 1 and ledger.failure_rows == 8
    end = ledger.read_results(0, told.append)
    assert told == [len(lines(row(0, "b"), row(1)))]  # the unreadable line's offset
    assert end == shard.size(FILES.results)


def test_a_file_that_shrank_is_read_again_from_the_start(shard: RunDir) -> None:
    ledger = ShardLedger.read(shard, "0", planned=True)
    Path(shard.path(FILES.results)).write_bytes(lines(row(3)))
    ledger.refresh()
    assert ledger.landed_keys == {(3, 0)} and ledger.duplicates == 0
    assert ledger.planned == 8  # the planned rows are kept
    assert dict(ledger.failed) == {
        "worker_lost": 1,
        "agent_request_failed": 1,
        "agent_run_error": 1,
    }


def test_an_absent_shard_is_empty(tmp_path: Path) -> None:
    ledger = count_shard(RunDir(str(tmp_path)), "0")
    assert (ledger.planned, ledger.landed, ledger.failure_rows, dict(ledger.failed)) == (
        0,
        0,
        0,
        {},
    )


def test_the_state_is_rebuilt_from_the_ledger_and_a_torn_tail_is_cut(
    shard: RunDir, r: redis.Redis
) -> None:
    write_manifest(shard, bare_manifest("run-x", 8, "tok"))
    st = ShardState(r, shard, "0")
    state = st.rebuild()
    assert state == read_state(r, st.sid)
    assert state[OPENER] == "tok" and state[BUILT] == "1"
    assert int(state[RESULTS_SIZE]) == shard.size(FILES.results)  # the torn line was cut
    assert not shard.read_bytes(FILES.results).endswith(TORN)
    candidates = [f"{t}:{ro}" for t in range(10) for ro in range(3)]
    flags = landed.present(r, st.sid, candidates)
    assert {k for k, f in zip(candidates, flags, strict=True) if f} == {"0:0", "1:0", "6:0"}
    assert landed.count(r, st.sid) == 3
    assert r.exists(keys.shard_landed_bits(st.sid, 0)) and not r.exists(keys.shard_landed(st.sid))
    counts = {k.decode(): int(v) for k, v in r.hgetall(keys.shard_counts(st.sid)).items()}  # type: ignore[union-attr]
    assert {k: v for k, v in counts.items() if not k.startswith("agent:")} == {
        "landed": 3,
        "duplicates": 1,
        "landed_masked": 0,
        "landed_unscored": 3,  # these rows carry no reward
        "failed:agent_run_error": 3,
        "failed:worker_lost": 1,
        "failed:judge_failed": 1,
        "failed:agent_request_failed": 1,
    }
    # Per agent, for the status file: planned, landed and failure rows by class.
    assert counts["agent:planned|a"] == 4 and counts["agent:planned|b"] == 4
    assert counts["agent:landed|b"] == 2 and counts["agent:failed:agent_run_error|a"] == 2
    # A writer that died before committing left two lines: adopted, counted once each.
    with open(shard.path(FILES.results), "ab") as f:
        f.write(lines(row(4), row(4)))
    state = st.load(state)
    assert int(state[RESULTS_SIZE]) == shard.size(FILES.results)
    assert landed.present(r, st.sid, ["4:0", "5:0"]) == [True, False]


def test_one_pass_over_the_results_counts_as_the_ledger_does(shard: RunDir) -> None:
    """The finish step folds the results into the ledger while it aggregates them: failures
    first, results after, and the same accounting as `count_shard` reading them in its order."""
    from schemas.config import ServersConfig
    from schemas.settings import CollectionSettings
    from workers.shard.scored import ScoredRows

    expected = count_shard(shard, "0")
    ledger = ShardLedger(shard, FILES)
    ledger.read_planned()
    ledger.read_failures()
    config = ServersConfig()
    rows = list(ScoredRows.of(shard, ledger, config, CollectionSettings(), fold=True))
    assert len(rows) == 5  # every readable row, the duplicate and the keyless one included
    assert set(ledger.landed_keys) == set(expected.landed_keys)
    assert ledger.duplicates == expected.duplicates and ledger.planned == expected.planned
    assert ledger.failed == expected.failed and ledger.failed_by == expected.failed_by
    assert ledger.attempts == expected.attempts and ledger.latest == expected.latest
    assert ledger.landed_by == expected.landed_by
