"""Opening a shard: the manifest and its generation, clean Redis state.

`open_planned` writes a planned shard's manifest (`producer/planning/materialize.py` planned it
and built it with `new_manifest`) with its first generation, once, when the Redis it coordinates
through is known, and resets the shard's Redis state (`open_run` plans and opens, for tests and
benchmarks). `record_opening` is the one builder of the generation that opens a shard, for a
fresh run, a resume and a recorded API call; `reset_shard_state` gives
a fresh shard Redis state that names the opener token. The materialized inputs are read back,
row by row, by `iter_materialized`; a generation records its Redis redacted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import redis

from infra import jsonl, keys
from infra.redis_client import client
from infra.runs import write_manifest
from infra.store import RunDir, ShardFiles
from producer.planning.materialize import PlannedShard, plan_shard
from schemas.config import redact_url
from schemas.messages import RunRef
from schemas.records import Generation, Manifest, utc_now
from schemas.settings import CollectionSettings
from workers.shard.state import write_state


def new_token() -> str:
    return uuid.uuid4().hex


@dataclass
class OpenedRun:
    """A shard whose inputs and manifest are on storage, ready to enqueue."""

    rd: RunDir
    manifest: Manifest
    run: RunRef

    @property
    def files(self) -> ShardFiles:
        return ShardFiles(self.manifest.shard)


def record_opening(
    rd: RunDir,
    manifest: Manifest,
    *,
    kind: Literal["run", "resume"],
    enqueued: int,
    redis_url: str | None,
    token: str | None = None,
    settings: CollectionSettings | None = None,
    overrides: dict[str, Any] | None = None,
    broker_url: str | None = None,
    local: bool = False,
    reserved: str | None = None,
) -> OpenedRun:
    """Append the generation that opens the shard now and write the manifest, once.

    The one place a shard's opening is recorded: a fresh run, a resume and a recorded API call.
    The generation names the Redis it coordinates through and the broker (redacted), or that its
    cluster was `local`, so `rollouts resume`, `status` and `cancel` find them. The shard is
    running again; a resume records the `settings` it runs with, the `overrides` that changed
    them and the rollouts it is about to dispatch (`reserved`, `workers/shard/reservations.py`):
    written before any task is, so the newest reserved execution of each rollout is on storage.
    """
    token = token or new_token()
    manifest.state = "running"
    manifest.error = None
    manifest.finished = None
    if settings is not None:
        manifest.settings = settings.model_dump(mode="json")
    manifest.generations.append(
        Generation(
            token=token,
            kind=kind,
            started_at=utc_now(),
            enqueued=enqueued,
            redis_url=redact_url(redis_url) if redis_url is not None else None,
            broker_url=redact_url(broker_url) if broker_url is not None else None,
            local=local,
            overrides=overrides or {},
            reserved=reserved,
        )
    )
    write_manifest(rd, manifest)
    run = RunRef(
        run_id=manifest.run_id,
        output_dir=rd.url,
        shard=manifest.shard,
        token=token,
        generation=len(manifest.generations) - 1,
    )
    return OpenedRun(rd, manifest, run)


def open_planned(
    planned: PlannedShard,
    redis_url: str | None = None,
    token: str | None = None,
    r: redis.Redis | None = None,
    *,
    broker_url: str | None = None,
    local: bool = False,
) -> OpenedRun:
    """Write a planned shard's manifest with its first generation (`kind` run), once, and give
    the shard clean Redis state naming its opener token (when its Redis is given: `redis_url`,
    or the client `r` for it)."""
    opened = record_opening(
        planned.rd, planned.manifest, kind="run", enqueued=planned.manifest.planned,
        redis_url=redis_url, token=token, broker_url=broker_url, local=local,
    )  # fmt: skip
    if redis_url is not None:
        reset_shard_state(r or client(redis_url), opened)
    return opened


def open_run(*, redis_url: str | None = None, **plan: Any) -> OpenedRun:
    """`plan_shard(**plan)`, then `open_planned`: plan the input and open the shard, enqueue nothing."""
    return open_planned(plan_shard(**plan), redis_url)


def reset_shard_state(r: redis.Redis, opened: OpenedRun) -> None:
    """Give a freshly opened shard clean Redis state naming its opener token."""
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    pipe = r.pipeline(transaction=True)
    pipe.delete(*keys.all_shard_keys(sid))
    write_state(
        pipe,
        sid,
        opener=opened.run.token,
        run_id=opened.manifest.run_id,
        shard=opened.manifest.shard,
        planned=opened.manifest.planned,
        results_size=opened.rd.size(opened.files.results),
        failures_size=opened.rd.size(opened.files.failures),
    )
    pipe.execute()


def iter_materialized(rd: RunDir, shard: str) -> Iterator[dict[str, Any]]:
    for _, line in rd.iter_lines(ShardFiles(shard).materialized):
        if line.strip():
            yield jsonl.loads(line)
