"""The provisional summary of a stopped run: its accounting, fast, without reading a rollout.

After SIGTERM a cluster scheduler kills the job within seconds to minutes, and reading a large
shard takes longer, so the summary is built from what is small: the shard's Redis state (the
landed set is the exactly-once guard, so its size is exactly the distinct rollouts in
`rollouts-S.jsonl`; read in one MULTI with the counters so they agree), the failures sidecar
(failure rows are small), the manifest's planned count, and the rollouts per (agent,
environment server) that the dispatcher counted while enqueueing. Duplicates and scores come
from reading the records, so they stay null; `healthy` is false when a failure limit is already
reached, else null.
"""

from __future__ import annotations

from collections import Counter

import redis

from infra import keys
from infra.store import RunDir, ShardFiles
from schemas.health import RUN_CHECK, Limits, Source
from schemas.quality_summary import SummaryRun
from schemas.records import rate_limit_waits
from workers.health.accounting import Accounting, SourceCounts, excessive_failures
from workers.health.check import write_summary
from workers.health.registry import normalize_ignored
from workers.shard import landed, state
from workers.shard.ledger import Reserved, ShardLedger

MEMBER_BATCH = 10_000


def provisional_accounting(
    r: redis.Redis,
    rd: RunDir,
    shard: str,
    planned: int,
    group_owed: Counter[tuple[str | None, str | None]] | None,
    reserved: Reserved | None = None,
) -> Accounting:
    """The stopped shard's accounting from Redis, the sidecar and the dispatcher's counts;
    `reserved` selects each rollout's standing failure as the coverage does."""
    sid = keys.shard_id(rd.url, shard)
    pipe = r.pipeline(transaction=True)
    pipe.hget(keys.shard_state(sid), state.BUILT)
    pipe.hgetall(keys.shard_counts(sid))
    built, raw_counts = pipe.execute()
    landed_count = landed.count(r, sid)
    counts = {k.decode(): int(v) for k, v in raw_counts.items()}
    if built != b"1":
        # Redis lost the shard's state; its counters would undercount.
        raise RuntimeError(f"Redis holds no state for {rd.url} shard {shard}")
    source = SourceCounts(
        has_inventory=True,
        drained=counts.get("drained", 0),
        rate_limit_waits=rate_limit_waits(counts),
    )
    acc = Accounting([source], records_read=False, groups_known=group_owed is not None)
    source.owed = planned
    source.landed = landed_count
    if group_owed is not None:
        acc.group_owed.update(group_owed)
    failures = ShardLedger(rd, ShardFiles(shard), reserved=reserved)
    failures.read_failures()
    latest = failures.latest
    # An older generation's failure of a rollout a resume dispatched again does not stand.
    failed_keys = [k for k, f in latest.items() if failures.stands(k, f)]
    for i in range(0, len(failed_keys), MEMBER_BATCH):
        batch = failed_keys[i : i + MEMBER_BATCH]
        members = [f"{t}:{ro}" for t, ro in batch]
        for key, present in zip(batch, landed.present(r, sid, members), strict=True):
            if present:
                continue
            failure = latest[key]
            if failure.omitted:
                acc.omitted += 1
            else:
                acc.add_failed(failure.cls, failure.agent, failure.env)
    source.no_outcome = max(0, planned - source.landed - sum(acc.failed.values()))
    return acc


def write_provisional(
    rd: RunDir,
    shard: str,
    r: redis.Redis,
    *,
    planned: int,
    group_owed: Counter[tuple[str | None, str | None]] | None,
    limits: Limits,
    ignored: list[str],
    reserved: Reserved | None = None,
    coverage_of: list[Source] | None = None,
) -> SummaryRun:
    """Write the provisional `quality_summary.json` of a stopped shard; returns its `run`.
    `coverage_of`: the shard's source, when its coverage record was written (`run.coverage`)."""
    acc = provisional_accounting(r, rd, shard, planned, group_owed, reserved)
    ignored_ids = list(normalize_ignored(ignored))
    check = excessive_failures(acc, limits, RUN_CHECK in ignored_ids)
    sources = [ShardFiles(shard).results]
    return write_summary(
        rd, "provisional", limits, sources, ignored_ids, accounting=acc, check=check,
        coverage_of=coverage_of,
    )  # fmt: skip
