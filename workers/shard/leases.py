"""The rollout lease table's layout: one owner for what every process reads of it.

Per shard, a hash `task:rollout` -> the JSON lease of the attempt running that rollout now
(`keys.shard_rollout_leases`); cluster-wide, one sorted set of every held lease by expiry
(`keys.ROLLOUT_LEASES`), whose members name the shard and the rollout (`lease_member`). The
leases are taken, renewed, taken over and settled by `workers/rollout/leases.py` (and its Lua
scripts); `rollouts status` reads them here.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from infra import keys


def lease_member(sid: str, key: str) -> str:
    """The expiry set's member for rollout `key` (`task:rollout`) of shard `sid`."""
    return f"{sid}|{key}"


def lease_rows(r: redis.Redis, sid: str) -> list[dict[str, Any]]:
    """The shard's rollout leases as stored, each with its `key` and `expiry` (Redis time)."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_rollout_leases(sid))  # type: ignore[assignment]
    if not raw:
        return []
    members = [lease_member(sid, k.decode()) for k in raw]
    expiries = r.zmscore(keys.ROLLOUT_LEASES, members)
    rows = []
    for (k, v), expiry in zip(raw.items(), expiries, strict=True):
        row = json.loads(v)
        row["key"] = k.decode()
        row["expiry"] = expiry
        rows.append(row)
    return rows
