"""What a recorded call's shard already holds, read back when replies were lost.

Replies live in Redis until the caller pops them; a Redis that restarts without its data, or a
caller that dies, loses those in flight. The shard's files do not: a rollout that landed is in
`rollouts-S.jsonl`, and one whose failure was final is in the sidecar. `Inventory` reads both,
keyed by rollout (`task:rollout`), so that a landed rollout resolves from its file and is never
run again; `unsettle` lets a rollout that settled without a file record (drained, cancelled,
not persisted) run again, since nothing else can give its outcome back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from infra import jsonl, keys
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from workers.shard.state import key_str


@dataclass
class Inventory:
    """The landed results and the last failure row of each rollout of one shard, by key."""

    landed: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def read(cls, output_dir: str, shard: str, wanted: set[str]) -> Inventory:
        """The records of the rollouts in `wanted` (their keys), in the order the files hold them."""
        rd, files = RunDir(output_dir), ShardFiles(shard)
        found = cls()
        for name, into in ((files.results, found.landed), (files.failures, found.failed)):
            if not rd.exists(name):
                continue
            for _, line in rd.iter_lines(name):
                row = jsonl.loads(line) if line.strip() else None
                if isinstance(row, dict) and F.TASK_INDEX in row and F.ROLLOUT_INDEX in row:
                    key = key_str(row)
                    if key in wanted:
                        into[key] = row
        return found


def unsettle(r: redis.Redis, sid: str, token: str, key: str) -> None:
    """Clear `key`'s settled mark in generation `token`, wherever the settling script put it (a
    bit, else a set member; `infra/scripts.py`), so that a delivery of it runs again."""
    task, rollout = (int(x) for x in key.split(":", 1))
    r.srem(keys.shard_settled(sid, token), key)
    if rollout < keys.LANDED_BITS_ROLLOUTS:
        bits = keys.shard_settled_bits(sid, token, rollout)
        # Only a bit that is set: SETBIT on a missing key would make a key without an expiry.
        if r.getbit(bits, task):
            r.setbit(bits, task, 0)
