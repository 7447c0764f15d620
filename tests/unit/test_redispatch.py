"""A rollout task's message kept with its lease, and the sweep's view of unstarted messages:
the chord's collect task and the Python API's reply task alike."""

from __future__ import annotations

import json
import time
from typing import Any

import fakeredis

from infra import keys
from schemas import fields as F
from schemas.messages import COLLECT_TASK, QUEUE
from schemas.replies import COLLECT_REPLY_TASK, admission_row
from tests.engine_helpers import as_kept
from workers.redispatch import CollectTaskMessage, UnackedSweep, from_delivered

RUN = {"run_id": "r", "output_dir": "file:///nowhere", "shard": "0", "token": "gen-1"}
ROW = {F.TASK_INDEX: 7, F.ROLLOUT_INDEX: 2, F.AGENT_REF: {"name": "a"}}


def test_a_reply_task_s_message_is_published_again_under_its_own_name_without_a_chord() -> None:
    payload = {"run": RUN, "row": ROW, "reply": {"invocation": "i", "index": 4, "record": False}}
    m = CollectTaskMessage("i.4", payload, "rollout=7-2", task=COLLECT_REPLY_TASK)
    kept = as_kept(m)
    assert kept["headers"]["task"] == COLLECT_REPLY_TASK and kept["headers"]["group"] is None
    assert from_delivered(kept) == m
    # A chord's collect task is found with its chord; one sent outside a chord is not a rollout
    # any takeover publishes again.
    chord = CollectTaskMessage("r.5", {"run": RUN, "row": ROW}, "x", "g", 5, {"task": "f"})
    assert from_delivered(as_kept(chord)) == chord
    assert from_delivered(as_kept(CollectTaskMessage("t", {"run": RUN, "row": ROW}, "x"))) is None
    assert CollectTaskMessage.from_json(m.to_json()) == m
    assert CollectTaskMessage.from_json({"task_id": "t", "payload": {}, "argsrepr": ""}).task == (
        COLLECT_TASK
    )  # a message kept before the field existed


def test_an_unrecorded_reply_task_is_keyed_by_its_index_in_the_call() -> None:
    unrecorded = {"invocation": "i", "index": 4, "record": False}
    assert F.rollout_key(admission_row(ROW, unrecorded)) == (4, 0)
    assert admission_row(ROW, {**unrecorded, "record": True}) is ROW
    assert admission_row(ROW, None) is ROW
    # The sweep looks for the lease under the same key the delivery takes it.
    r = fakeredis.FakeRedis()
    payload = {"run": RUN, "row": ROW, "reply": unrecorded}
    kept = as_kept(CollectTaskMessage("i.4", payload, "x", task=COLLECT_REPLY_TASK))
    r.hset(keys.KOMBU_UNACKED, "tag1", json.dumps([kept, "", QUEUE]))
    r.zadd(keys.KOMBU_UNACKED_INDEX, {"tag1": time.time() - 60})
    sid = keys.shard_id(RUN["output_dir"], RUN["shard"])
    r.hset(keys.shard_rollout_leases(sid), "4:0", "{}")
    published: list[dict[str, Any]] = []
    sweep = UnackedSweep(r, r, published.append, ttl_s=1.0)
    assert sweep.sweep() == 0  # it started: its lease is held
    r.hdel(keys.shard_rollout_leases(sid), "4:0")
    r.hset(keys.shard_rollout_leases(sid), "7:2", "{}")  # the row's own key is not its lease
    assert sweep.sweep() == 1 and published[0]["task"] == COLLECT_REPLY_TASK
