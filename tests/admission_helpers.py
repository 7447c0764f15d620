"""A shard as the admission tests set it up in Redis: its identity, its dispatch generation, and
the request of one of its rollout tasks."""

from __future__ import annotations

from typing import Any

import redis

from infra import keys
from schemas.messages import Admission, CallPolicy, CollectRequest, RunRef

TOKEN = "tok-1"
URL = "file:///tmp/run-admission"
SID = keys.shard_id(URL, "0")


def open_generation(r: redis.Redis) -> redis.Redis:
    """The shard's dispatch generation in Redis: token `TOKEN`, 10 rollouts enqueued."""
    r.hset(keys.shard_generation(SID), mapping={"token": TOKEN, "enqueued": 10})
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
