"""The chord callback's work: aggregate metrics per environment server, final status, manifest state."""

from __future__ import annotations

import logging
from typing import Any

from infra import jsonl, keys
from infra.http import process_io
from infra.redis_client import client
from infra.runs import read_manifest, write_manifest, write_status
from infra.store import RunDir, ShardFiles
from schemas.config import ServersConfig
from schemas.messages import RunRef
from schemas.settings import CollectionSettings
from workers.accounting import count_shard, iter_rows
from workers.aggregation import aggregate, group_rows
from workers.landing import compact_shard

log = logging.getLogger(__name__)


def write_aggregate(rd: RunDir, shard: str, config: ServersConfig) -> str | None:
    """Aggregate the shard's results and save the file; returns the first error's text, if any."""
    files = ShardFiles(shard)
    groups = group_rows(iter_rows(rd, files.results), config)
    if not groups:
        return None
    entries, error = process_io().loop.run(aggregate(groups, config))
    rd.write_atomic(files.aggregate, jsonl.dumps_pretty(entries))
    if error is not None:
        return f"{type(error).__name__}: {error}"
    return None


def finish_shard(run: RunRef, redis_url: str) -> dict[str, Any]:
    """Finish a shard after its last rollout task returned."""
    rd = RunDir(run.output_dir)
    manifest = read_manifest(rd, run.shard)
    if manifest.token != run.token:
        log.warning(
            "finish of %s shard %s skipped: superseded by a later dispatch", rd.url, run.shard
        )
        return {"state": "superseded"}
    config = ServersConfig.model_validate(manifest.config)
    settings = CollectionSettings.model_validate(manifest.settings)
    sid = keys.shard_id(rd.url, run.shard)
    # Every appended file becomes one object before anything reads it for the reports: after a
    # run finishes, any JSONL reader reads it.
    compact_shard(client(redis_url), rd, run.shard)
    raw = client(redis_url).get(keys.shard_run_failed(sid))
    run_error = raw.decode() if isinstance(raw, bytes) else None

    aggregation_error = None
    if not settings.disable_aggregation:
        aggregation_error = write_aggregate(rd, run.shard, config)
    counts = count_shard(rd, run.shard)
    write_status(rd, counts.status(manifest.run_id, run.shard))

    manifest.state = "failed" if run_error else "completed"
    manifest.error = run_error
    if aggregation_error and not run_error:
        manifest.error = f"aggregation failed: {aggregation_error}"
    write_manifest(rd, manifest)
    return {
        "state": manifest.state,
        "error": manifest.error,
        "landed": counts.landed,
        "planned": counts.planned,
        "aggregation_error": aggregation_error,
    }
