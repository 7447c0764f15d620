"""A reply that parses but cannot be stored fails alone (docs/explanation/contract.md#failures), through `rollouts run`.

The example agent answers every fifth task with JSON nested 300 levels deep: orjson reads up to
1,024 levels but writes at most 254, so the lander cannot encode the result. That rollout gets a
`result_not_stored` failure row; the good rollouts batched with it land, and every task returns.
"""

from __future__ import annotations

import pytest
import redis

from examples.agent_server import AgentKnobs
from infra import keys
from infra.store import RunDir
from schemas import fields as F
from tests.helpers import demo_rows
from tests.ops_helpers import manifest, rows_by_key, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

ROWS = 100
EVERY = 5


def test_deep_replies_fail_alone_and_every_rollout_has_an_outcome(
    make_run: MakeRun, r: redis.Redis
) -> None:
    knobs = AgentKnobs(deep_reply_every=EVERY, deep_reply_depth=300)
    run = make_run(knobs=knobs, workers=2, concurrency=16)
    out = run.out
    proc = run.cli(demo_rows(ROWS), "+route_failures_to_sidecar=true", timeout=180)
    run.servers.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert manifest(out)["state"] == "completed"

    deep = {(t, 0) for t in range(0, ROWS, EVERY)}
    landed = rows_by_key(out / "rollouts-0.jsonl")
    failures = rows_by_key(out / "rollouts-0_failures.jsonl")
    assert set(landed) == {(t, 0) for t in range(ROWS)} - deep  # all 80 good ones
    assert all(len(rows) == 1 for rows in landed.values())
    assert set(failures) == deep  # and each deep one has its failure row
    for rows in failures.values():
        [row] = rows
        assert row[F.FAILURE_CLASS] == "result_not_stored"
        assert row[F.FAILURE_TYPE] == "JSONEncodeError"
        assert "Recursion limit" in row[F.FAILURE_MESSAGE]
        assert "nested" not in row and "response" not in row  # identity and cause only

    # No task outlives the run: every delivery ended, no slot is held, no message is unacked.
    sid = keys.shard_id(RunDir(str(out)).url, "0")
    assert r.hlen(keys.shard_starts(sid)) == 0
    assert r.zcard(keys.shard_leases(sid)) == 0
    wait_for(lambda: r.hlen("unacked") == 0, 10, "the last acks")  # written in batches
    counts = {k.decode(): int(v) for k, v in r.hgetall(keys.shard_counts(sid)).items()}  # type: ignore[union-attr]
    assert counts["landed"] == ROWS - len(deep)
    assert counts["failed:result_not_stored"] == len(deep)
    assert "Traceback" not in run.workers.output()
