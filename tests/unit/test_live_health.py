"""Live health (issue 40, item 5): the verdict the landing worker counts is the finish step's,
and the lander counts each new result once, in Redis, beside its landed key.

Redis is the session's real server; storage a tmp dir.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis

from infra import keys
from infra.store import RunDir
from producer.shard.live import live_health, snapshot
from schemas.health import LiveHealth, RolloutVerdict
from schemas.messages import HealthRef, RunRef
from tests.health_fixtures import crafted_folder, crafted_records, read_verdicts
from tests.shard_helpers import open_run
from workers.health import plan_recheck, run_local
from workers.health.live import judge, rollout_verdict
from workers.rollout.landing import Lander


def test_the_live_verdict_is_the_finish_steps_for_every_crafted_record(tmp_path: Path) -> None:
    folder = crafted_folder(tmp_path)
    run_local(plan_recheck(str(folder)))
    lines = {
        (v["_ng_task_index"], v["_ng_rollout_index"]): v
        for v in read_verdicts(folder)
        if not any(f["check"] == "rollout_duplicate_identity" for f in v["findings"])
    }
    compared = 0
    for raw in crafted_records():
        if not isinstance(raw, dict) or "_ng_task_index" not in raw:
            continue  # unreadable and positional lines never reach a lander
        key = (raw["_ng_task_index"], raw["_ng_rollout_index"])
        if key not in lines:
            continue  # a duplicate: judged only across records
        line = lines[key]
        live = rollout_verdict(orjson.loads(orjson.dumps(raw)), frozenset())
        assert live.verdict == line["verdict"], key
        assert list(live.findings) == [f["check"] for f in line["findings"]], key
        compared += 1
    assert compared == 17


def test_judge_is_off_without_health_and_never_raises() -> None:
    assert judge(None, {"reward": 1.0}) is None
    assert judge(HealthRef(), None) is None
    ignored = HealthRef(ignored=["rollout_response_empty"])
    empty = {"response": {"status": "completed", "output": []}}
    assert judge(HealthRef(), empty) == RolloutVerdict("unhealthy", ("rollout_response_empty",))
    # No trajectory: NeMo Gym's checks lack their evidence, and nothing else was found.
    assert judge(ignored, empty) == RolloutVerdict("unobserved")


def land(lander: Lander, run: RunRef, task: int, verdict: RolloutVerdict | None) -> Any:
    encoded = lander.encode({"_ng_task_index": task, "_ng_rollout_index": 0, "reward": 1.0}, [])
    encoded.health = verdict
    return lander.enqueue(run, encoded).result(timeout=60)


def test_the_lander_counts_each_new_result_once(redis_url: str, tmp_path: Path) -> None:
    r = redis.Redis.from_url(redis_url)
    rd = RunDir(str(tmp_path / "run"))
    rd.makedirs()
    run = open_run(r, rd, "run-live", planned=10)
    lander = Lander(redis_url)
    bad = RolloutVerdict(
        "unhealthy", ("model_call_failed", "model_call_failed", "agent_turn_hollow")
    )
    assert land(lander, run, 0, RolloutVerdict("healthy")).landed
    assert land(lander, run, 1, bad).landed
    assert land(lander, run, 2, RolloutVerdict("unobserved")).landed
    assert land(lander, run, 3, None).landed  # not judged: not counted
    assert land(lander, run, 1, bad).duplicate  # a redelivery: counted nothing
    sid = keys.shard_id(rd.url, "0")
    fields = live_health(r, sid)
    assert fields == {
        "healthy": 1, "unhealthy": 1, "unobserved": 1,
        "issues:model_call_failed": 2, "issues:agent_turn_hollow": 1,
    }  # fmt: skip
    assert snapshot(r, sid).health == fields
    assert LiveHealth.of(fields).model_dump() == {
        "verdicts": {"healthy": 1, "unhealthy": 1, "unobserved": 1},
        "issues": {"agent_turn_hollow": 1, "model_call_failed": 2},
    }
    assert r.ttl(keys.shard_health(sid)) > 0  # it expires with the shard's keys
    assert Counter(bad.counter_fields()) == Counter(
        {"unhealthy": 1, "issues:model_call_failed": 2, "issues:agent_turn_hollow": 1}
    )
    r.close()


def test_a_finish_task_waiting_for_the_reader_ahead_counts_as_finishing(redis_url: str) -> None:
    """The producer's stall watch sees a shard as finishing while its finish task waits for the
    worker reading it ahead (`workers/finish_ahead.py`): the reader lock of the generation the
    finish task asked for, not a reader alone (it reads while the rollouts still run) nor an
    old generation's ask."""
    r = redis.Redis.from_url(redis_url)
    sid = "ahead"
    assert not snapshot(r, sid).finishing
    r.set(keys.shard_reading(sid), "t2:123-abc")
    assert not snapshot(r, sid).finishing  # reading while the rollouts run
    r.set(keys.shard_finish_asked(sid), "t1")
    assert not snapshot(r, sid).finishing  # an older generation's finish asked
    r.set(keys.shard_finish_asked(sid), "t2")
    assert snapshot(r, sid).finishing
    r.delete(keys.shard_reading(sid))
    assert not snapshot(r, sid).finishing  # the reader ended: the finish lock says the rest
    r.set(keys.shard_finishing(sid), "x")
    assert snapshot(r, sid).finishing
