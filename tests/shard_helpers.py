"""A shard as the unit tests set it up: its manifest, opened in Redis (the landing tests), or
only its identity, its dispatch generation and a rollout task's request (the admission tests)."""

from __future__ import annotations

import uuid
from typing import Any

import redis

from infra import generation, keys
from infra.runs import write_manifest
from infra.store import RunDir
from schemas.messages import Admission, CallPolicy, CollectRequest, RunRef
from schemas.records import Generation, InputSource, Manifest, utc_now
from workers.shard.state import open_shard

TOKEN = "tok-1"
URL = "file:///tmp/run-admission"
SID = keys.shard_id(URL, "0")


def open_generation(r: redis.Redis) -> redis.Redis:
    """The shard's dispatch generation in Redis: token `TOKEN`, 10 rollouts enqueued."""
    r.hset(keys.shard_generation(SID), mapping={generation.TOKEN: TOKEN, generation.ENQUEUED: 10})
    return r


def request(
    task: int, rollout: int = 0, agent_url: str = "http://127.0.0.1:1", **admission: Any
) -> CollectRequest:
    """The request of rollout `task:rollout` of the shard, with `admission`'s caps."""
    return CollectRequest(
        run=RunRef(run_id="r", output_dir=URL, shard="0", token=TOKEN),
        agent_url=agent_url,
        policy=CallPolicy(max_attempts=admission.pop("max_attempts", 3)),
        row={"_ng_task_index": task, "_ng_rollout_index": rollout, "agent_ref": {"name": "a"}},
        admission=Admission(**admission),
    )


def bare_manifest(run_id: str, planned: int, token: str) -> Manifest:
    """Shard 0's manifest with no config or settings, and one generation: the run's, `token`."""
    return Manifest(
        run_id=run_id,
        shard="0",
        created_at=utc_now(),
        input=InputSource(path="rows.jsonl", sha256="0"),
        config={},
        settings={},
        planned=planned,
        materialized_sha256="0",
        generations=[Generation(token=token, kind="run", started_at=utc_now(), enqueued=planned)],
    )


def open_run(r: redis.Redis, rd: RunDir, run_id: str = "run-test", planned: int = 100) -> RunRef:
    """Shard 0 of a run in `rd`, its manifest written and the shard opened, as `rollouts run`
    leaves it before it dispatches."""
    token = uuid.uuid4().hex
    write_manifest(rd, bare_manifest(run_id, planned, token))
    open_shard(r, rd, "0")
    return RunRef(run_id=run_id, output_dir=rd.url, shard="0", token=token)
