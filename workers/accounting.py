"""Counting a shard from its files: what landed, what failed and how, what is still owed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.records import ShardStatus


def iter_rows(rd: RunDir, name: str) -> Any:
    """Yield each JSON object of a JSONL file; unreadable lines are skipped."""
    for _, row in rd.iter_objects(name):
        if row is not None:
            yield row


@dataclass
class ShardCounts:
    """Counts of a shard read from storage."""

    planned: int = 0
    landed: int = 0
    duplicates: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    failure_rows: int = 0

    def status(self, run_id: str, shard: str) -> ShardStatus:
        return ShardStatus(
            run_id=run_id,
            shard=shard,
            planned=self.planned,
            landed=self.landed,
            failed=dict(sorted(self.failed.items())),
            duplicates=self.duplicates,
        )


def count_shard(rd: RunDir, shard: str) -> ShardCounts:
    """Landed keys, duplicate lines, and per class the rollouts whose latest failure did not land."""
    files = ShardFiles(shard)
    counts = ShardCounts()
    counts.planned = sum(1 for _ in rd.iter_lines(files.materialized))
    landed: set[tuple[int, int]] = set()
    for row in iter_rows(rd, files.results):
        try:
            key = F.rollout_key(row)
        except (KeyError, TypeError, ValueError):
            continue
        if key in landed:
            counts.duplicates += 1
        landed.add(key)
    counts.landed = len(landed)
    latest: dict[tuple[int, int], str] = {}
    for row in iter_rows(rd, files.failures):
        counts.failure_rows += 1
        try:
            key = F.rollout_key(row)
        except (KeyError, TypeError, ValueError):
            continue
        latest[key] = str(row.get(F.FAILURE_CLASS) or "unknown")
    counts.failed = Counter(cls for key, cls in latest.items() if key not in landed)
    return counts
