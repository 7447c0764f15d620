"""Helpers for the queue window's tests (`workers/window.py`): a shard's window hash, a run's end."""

from __future__ import annotations

from pathlib import Path

import redis

from infra import keys
from infra.store import RunDir
from tests.ops_helpers import manifest


def completed(out: Path) -> bool:
    """Whether shard 0's finish step wrote its manifest as completed."""
    path = out / "rollouts-0_manifest.json"
    return path.exists() and manifest(out)["state"] == "completed"


def window_hash(r: redis.Redis, out: Path) -> dict[str, str]:
    """Shard 0's window hash, without what its tasks are built from."""
    sid = keys.shard_id(RunDir(str(out)).url, "0")
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_window(sid))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items() if k != b"messages"}
