"""A feed rebuilt after Redis lost its data, from the shard's files and the acknowledgement log.

Every member that landed is in the shard's files (a result in `rollouts-S.jsonl`, a failure row
in the sidecar); every group a trainer acknowledged is in the run directory's log
(`infra/feed_log.py`). The rebuild marks the acknowledged groups delivered, with their members,
then lets every other landed member enter the feed again through the script the lander uses, as
the place of its line (`infra/feed_refs.py`):
groups whose members all landed are delivered again (they were not acknowledged), the others
wait for the rest. A member that lands meanwhile enters as usual; none enters twice.
"""

from __future__ import annotations

from typing import Any

import redis

from infra import jsonl, keys
from infra.feed import open_feed
from infra.feed_log import member_key, read_acks
from infra.feed_refs import line_ref
from infra.feed_scripts import FEED_LAND_LUA
from infra.store import RunDir, ShardFiles
from schemas.feed import FeedMember, FeedPlan
from workers.feed.publish import Landed, queue_members

BATCH = 500


def _landed(rd: RunDir, shard: str) -> dict[str, tuple[dict[str, Any], bytes, bool, bytes]]:
    """Each rollout's result, else its last failure row: (row, line, failed, the line's place
    as the lander gives it), by key."""
    files = ShardFiles(shard)
    found: dict[str, tuple[dict[str, Any], bytes, bool, bytes]] = {}
    for name, failed in ((files.failures, True), (files.results, False)):
        if not rd.exists(name):
            continue
        for offset, line in rd.iter_lines(name):
            row = jsonl.loads(line) if line.strip() else None
            key = member_key(row) if isinstance(row, dict) else None
            if key is not None and isinstance(row, dict):
                ref = line_ref(rd.url, name, offset, len(line), None)
                found[key] = (row, line, failed, ref)  # a result read last wins over failures
    return found


def rebuild_feed(r: redis.Redis, plan: FeedPlan, output_dir: str) -> int:
    """Rebuild `plan`'s feed from shard `plan.shard` of `output_dir`; returns the members that
    entered it again."""
    rd = RunDir(output_dir)
    open_feed(
        r, plan.name, output_dir, max_lag=plan.max_lag,
        writer=keys.shard_id(rd.url, plan.shard),
    )  # fmt: skip
    pipe = r.pipeline(transaction=True)
    for acked in read_acks(rd, plan.name):
        pipe.sadd(keys.feed_delivered(plan.name), acked.group)
        for member in acked.members:
            pipe.sadd(keys.feed_members(plan.name), f"{acked.group}\x00{member}")
    pipe.execute()
    script = r.register_script(FEED_LAND_LUA)
    members = []
    for key, (row, line, failed, ref) in _landed(rd, plan.shard).items():
        feed = FeedMember.model_validate(plan.member(row))
        members.append(Landed(feed, key, line, failed, ref))
    for start in range(0, len(members), BATCH):
        pipe = r.pipeline(transaction=True)
        queue_members(pipe, script, members[start : start + BATCH])
        pipe.execute()
    return len(members)
