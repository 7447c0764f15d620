"""A feed rebuilt from a shard's files and its acknowledgement log, on a real Redis: groups not
acknowledged come again, acknowledged ones never, and a second rebuild changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import redis

from infra import keys
from infra.feed_log import record_ack
from infra.store import RunDir
from schemas import fields as F
from schemas.feed import FeedPlan
from workers.feed.rebuild import rebuild_feed


def row(task: int, rollout: int, **extra: Any) -> dict[str, Any]:
    return {F.TASK_INDEX: task, F.ROLLOUT_INDEX: rollout, **extra}


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def test_a_rebuilt_feed_delivers_what_was_not_acknowledged_once(
    redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    planned = [row(t, i) for t in range(3) for i in range(2)]
    plan = FeedPlan.of("rb", planned, "0", None, 60.0)
    # Task 0 landed whole and was acknowledged; task 1 landed whole, one member with a failure
    # row; task 2 has one member landed.
    write(tmp_path / "rollouts-0.jsonl", [row(0, 0, reward=1), row(0, 1, reward=0),
                                          row(1, 0, reward=1), row(2, 0, reward=1)])  # fmt: skip
    write(tmp_path / "rollouts-0_failures.jsonl", [row(1, 1, _ng_failure_class="http_error")])
    record_ack(RunDir(str(tmp_path)), "rb", "0/0", [row(0, 0), row(0, 1)], "rank0")
    assert rebuild_feed(r, plan, str(tmp_path)) == 5
    assert rebuild_feed(r, plan, str(tmp_path)) == 5  # the same members: none enters twice
    entries: Any = r.xrange(keys.feed_stream("rb"))
    assert [(f[b"group"], f[b"reason"]) for _, f in entries] == [(b"0/1", b"failed")]
    assert r.zrange(keys.feed_open("rb"), 0, -1) == [b"0/2"]
