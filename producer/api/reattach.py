"""Picking up a recorded `run_examples` call whose caller died: `reattach(record_output_dir, ...)`.

A recorded call is its shard: the materialized inputs are its rows, the manifest its settings
and generation (whose opener token names the call's reply list, `keys.api_replies`), the files
what landed. Its workers go on without the caller: running rollouts land and reply, a dead
worker's rollouts are taken over. What the caller's death loses is the replies it popped and did
not hand out, and the rows it had not published yet. A new process that reattaches:

1. counts out the outcomes the dead caller handed out (`keys.api_consumed`, marked within a
   quarter of a second of each: one taken just before the death may be yielded again);
2. listens on the call's reply list, so replies pushed meanwhile are not missed;
3. resolves every other row the shard has an outcome for: a landed result, or, for a rollout
   that settled without landing, its last failure row; a rollout that settled with nothing on
   file (drained, cancelled, not persisted) is marked unsettled, to run again;
4. publishes the rest again: a copy of a rollout that runs elsewhere is acknowledged without a
   call (its lease is live) and the running attempt replies; a row never published runs now;
5. runs the shard's finish step once every row settled (the caller never did, having died
   first); a shard whose finish step ran already yields what it recorded and runs nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import redis

from infra import generation, keys
from infra.redis_client import client
from infra.runs import read_manifest
from infra.store import RunDir, ShardFiles
from producer.api.calls import (
    DEFAULT_CLOSE_TIMEOUT_S,
    Call,
    _config,
    _converter,
    _urls,
)
from producer.api.completions import Completions
from producer.api.inventory import Inventory, unsettle
from producer.api.model import Outcome, Target
from producer.api.transport import Invocation
from producer.config.loading import parse_servers_config
from producer.shard.celery_client import client_app
from producer.shard.dispatch import open_generation
from producer.shard.opening import iter_materialized
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import UsageError
from schemas.messages import RunRef
from schemas.outcomes import Ended
from schemas.settings import CollectionSettings
from workers.shard.landed import settled
from workers.shard.state import key_str

log = logging.getLogger(__name__)


def reattach(
    record_output_dir: str | os.PathLike[str],
    record_shard: str = "0",
    config: ServersConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    records: bool = False,
    record_omitted_rollouts: bool = False,
    max_resident_tasks: int | None = None,
    result_timeout_s: float | None = None,
    broker_url: str | None = None,
    redis_url: str | None = None,
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S,
) -> Completions:
    """Take over the recorded call of shard `record_shard` whose caller died; returns its
    awaitables, like `run_examples`, for the outcomes the caller had not handed out yet.

    Each awaitable resolves in completion order to `(row, result)`, `row` being the shard's
    materialized row (a copy stamped with the run's identity). Rollouts that ended while nobody
    listened come first, read from the shard; the rest come as they land. `records`: failures
    and drained rows come back as `RolloutFailureRecord`s, as `run_outcomes` yields them.
    `record_omitted_rollouts`: as for `run_examples`, the rows this call's close leaves without
    an outcome get `_ng_omitted` rows in the shard's sidecar (pass what the dead caller passed).
    `config`: the servers (default: the manifest's snapshot, secrets redacted). The call's
    other settings are the manifest's; `max_resident_tasks` caps the rows this process
    publishes again. Reattach only once the caller is gone: two listeners would share the
    replies.
    """
    rd = RunDir(os.fspath(record_output_dir))
    files = ShardFiles(record_shard)
    if not rd.exists(files.manifest) or not rd.exists(files.materialized):
        raise UsageError(f"record_output_dir= {rd.url}: no recorded shard {record_shard!r}")
    manifest = read_manifest(rd, record_shard)
    rows = list(iter_materialized(rd, record_shard))
    servers = (
        _config(config)
        if config is not None
        else parse_servers_config(manifest.config, f"the manifest of {rd.url}")
    )
    settings = CollectionSettings.model_validate(manifest.settings)
    if max_resident_tasks is not None:
        settings = settings.model_copy(update={"max_resident_tasks": max_resident_tasks})
    broker, state_url = _urls(broker_url, redis_url)
    token = manifest.token
    run = RunRef(
        run_id=manifest.run_id, output_dir=rd.url, shard=record_shard, token=token,
        generation=max(0, len(manifest.generations) - 1),
    )  # fmt: skip
    r = client(state_url)
    sid = keys.shard_id(rd.url, record_shard)
    running = manifest.state == "running"
    deadline = _deadline(r, sid, token, len(rows), running)
    agents = [str((row.get(F.AGENT_REF) or {}).get("name")) for row in rows]
    target = Target(
        client_app(broker, state_url), state_url, run, servers, settings, deadline, True,
        record_omitted_rollouts,
    )  # fmt: skip
    invocation = Invocation(
        token, rows, agents, target, window=settings.max_resident_tasks,
        close_timeout_s=close_timeout_s, result_timeout_s=result_timeout_s,
    )  # fmt: skip
    consumed = _consumed(r, token, len(rows))
    invocation.skip(consumed)
    invocation.finish_allowed = running
    invocation.on_start = lambda: _adopt(invocation, r, sid, running)
    log.warning("reattached to the call of shard %s of %s: %d of %d outcomes were handed out",
                record_shard, rd.url, len(consumed), len(rows))  # fmt: skip
    call = Call(enrich=True, records=records, record_output_dir=rd.url, run_id=run.run_id)
    convert = _converter(rows, settings, call, run.run_id, run.run_id)
    bounded = settings.max_resident_tasks is not None
    return Completions(len(rows) - len(consumed), invocation, convert, bounded)


def _deadline(r: redis.Redis, sid: str, token: str, total: int, running: bool) -> float | None:
    """The call's dispatch deadline, as its generation holds it; a generation Redis lost is
    opened again (without a budget: what was left of it is unknown)."""
    current = generation.read(r, sid)
    if current.token == token:
        return current.deadline
    if running:
        open_generation(r, sid, token, total, None)
    return None


def _consumed(r: redis.Redis, invocation: str, total: int) -> set[int]:
    """The rows whose outcome the dead caller handed out."""
    raw: bytes = r.get(keys.api_consumed(invocation)) or b""  # type: ignore[assignment]
    return {i for i in range(min(total, len(raw) * 8)) if raw[i // 8] >> (7 - i % 8) & 1}


def _adopt(invocation: Invocation, r: redis.Redis, sid: str, running: bool) -> None:
    """Resolve what the shard holds; the rest is published again (runs on the listener thread,
    before the publisher starts)."""
    run = invocation.target.run
    waiting = [i for i in range(invocation.total) if not invocation.settled(i)]
    by_key = {key_str(invocation.sent[i]): i for i in waiting}
    found = Inventory.read(run.output_dir, run.shard, set(by_key))
    again: list[int] = []
    for key, i in by_key.items():
        if key in found.landed:
            invocation.resolve(Outcome(i, Ended.LANDED, found.landed[key]))
        elif not running or settled(r, sid, run.token, key):
            failure = found.failed.get(key)
            if failure is not None:
                lost = failure.get(F.FAILURE_CLASS) == "worker_lost"
                invocation.resolve(Outcome(i, Ended.WORKER_LOST if lost else Ended.FAILED, failure))
            elif running:
                unsettle(r, sid, run.token, key)  # it settled with nothing on file: run it again
                again.append(i)
            else:
                error = (
                    "the shard finished without an outcome on file for it (drained or cancelled)"
                )
                invocation.resolve(Outcome(i, Ended.ERROR, error=error))
        else:
            again.append(i)
    invocation.to_publish = again
    log.warning("reattached call %s: %d outcomes read from the shard, %d rows sent again",
                invocation.invocation, len(waiting) - len(again), len(again))  # fmt: skip
