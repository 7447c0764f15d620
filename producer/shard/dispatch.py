"""Opening a run and enqueueing it: materialized inputs, manifest, Redis state, one task per rollout.

The rollout tasks form one Celery chord whose callback finishes the shard. The chord is published
from a stream of the materialized inputs, not built in memory: its size is known from planning,
set in the result backend first, and each task is sent with the chord's callback, its group id
and its index, exactly as Celery's own chord would send it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from celery import Celery

from infra import jsonl, keys
from infra.runs import maybe_manifest, write_manifest
from infra.store import RunDir, ShardFiles
from producer.planning.planner import PlanContext, WarningSink, write_plan
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem, RunExistsError, StorageError
from schemas.messages import (
    COLLECT_TASK,
    FINISH_TASK,
    QUEUE,
    Admission,
    CallPolicy,
    FinishRequest,
    RunRef,
)
from schemas.records import Generation, InputSource, Manifest, utc_now
from schemas.settings import CollectionSettings

PUBLISH_BATCH = 500


def new_run_id() -> str:
    return f"run-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def new_token() -> str:
    return uuid.uuid4().hex


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class OpenedRun:
    """A shard whose inputs and manifest are on storage, ready to enqueue."""

    rd: RunDir
    manifest: Manifest
    run: RunRef

    @property
    def files(self) -> ShardFiles:
        return ShardFiles(self.manifest.shard)


def shard_artifacts_present(rd: RunDir, shard: str) -> list[str]:
    return [name for name in ShardFiles(shard).all() if rd.exists(name)]


def existing_run_problem(rd: RunDir, shard: str, present: list[str]) -> Problem:
    """The problem of a fresh run into a folder whose shard belongs to an earlier run."""
    try:
        manifest = maybe_manifest(rd, shard)
    except StorageError:
        manifest = None
    if manifest is not None:
        owner = (
            f"run {manifest.run_id} ({manifest.state}, {manifest.planned} rollouts planned, "
            f"created {manifest.created_at})"
        )
    else:
        owner = "an earlier run (no readable manifest)"
    return Problem(
        f"already holds shard {shard} of {owner}: {', '.join(present)}; pass --overwrite to "
        f"replace it, or resume it with `rollouts resume {rd.url} --shard {shard}`",
        file=rd.url,
    )


def open_run(
    *,
    input_path: str,
    output_dir: str,
    shard: str,
    config: ServersConfig,
    settings: CollectionSettings,
    overwrite: bool = False,
    on_warning: WarningSink | None = None,
) -> OpenedRun:
    """Plan the input and write the materialized inputs and manifest; nothing is enqueued yet.

    Every problem (the shard label, the run directory, every input row) is raised in one error
    before the run directory is touched.
    """
    problems: list[Problem] = []
    label_ok = F.valid_shard_label(shard)
    if not label_ok:
        problems.append(
            Problem(
                f"invalid shard label {shard!r}: use letters, digits, '.', '_', '-'", field="shard"
            )
        )
    rd = RunDir(output_dir)
    present = shard_artifacts_present(rd, shard) if label_ok else []
    existing = existing_run_problem(rd, shard, present) if present and not overwrite else None
    if not os.path.isfile(input_path):
        problems.append(Problem("input file not found", file=input_path))
        raise PlanningError([*problems, *([existing] if existing else [])])
    run_id = new_run_id()
    files = ShardFiles(shard)
    tmpdir = tempfile.mkdtemp(prefix="rollouts-plan-")
    try:
        local = os.path.join(tmpdir, "materialized_inputs.jsonl")
        try:
            plan = write_plan(
                input_path,
                local,
                config,
                settings,
                PlanContext(run_id, shard),
                on_warning=on_warning,
            )
        except PlanningError as exc:
            raise PlanningError(
                [*problems, *exc.problems, *([existing] if existing else [])], header=exc.header
            ) from None
        if problems:
            raise PlanningError([*problems, *([existing] if existing else [])])
        if existing is not None:
            raise RunExistsError(f"{existing.render()}")
        if plan.planned == 0:
            raise PlanningError([Problem("no rows to run", file=input_path)])
        rd.makedirs()
        if overwrite:
            for name in present:
                rd.remove(name)
        if rd.is_local:
            shutil.move(local, rd.path(files.materialized))
        else:
            rd.fs.put_file(local, rd.path(files.materialized))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    token = new_token()
    manifest = Manifest(
        run_id=run_id,
        shard=shard,
        created_at=utc_now(),
        input=InputSource(path=os.path.abspath(input_path), sha256=sha256_file(input_path)),
        config=config.redacted(),
        settings=settings.model_dump(mode="json"),
        planned=plan.planned,
        materialized_sha256=plan.sha256,
        generations=[
            Generation(token=token, kind="run", started_at=utc_now(), enqueued=plan.planned)
        ],
    )
    write_manifest(rd, manifest)
    return OpenedRun(
        rd, manifest, RunRef(run_id=run_id, output_dir=rd.url, shard=shard, token=token)
    )


def reset_shard_state(r: redis.Redis, opened: OpenedRun) -> None:
    """Give a freshly opened shard clean Redis state naming its opener token."""
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    pipe = r.pipeline(transaction=True)
    pipe.delete(*keys.all_shard_keys(sid))
    pipe.hset(
        keys.shard_state(sid),
        mapping={
            "opener": opened.run.token,
            "run_id": opened.manifest.run_id,
            "shard": opened.manifest.shard,
            "planned": opened.manifest.planned,
            "results_size": opened.rd.size(opened.files.results),
            "failures_size": opened.rd.size(opened.files.failures),
            "built": "1",
        },
    )
    pipe.execute()


def iter_materialized(rd: RunDir, shard: str) -> Iterator[dict[str, Any]]:
    for _, line in rd.iter_lines(ShardFiles(shard).materialized):
        if line.strip():
            yield jsonl.loads(line)


def call_policy(settings: CollectionSettings) -> CallPolicy:
    return CallPolicy(
        timeout_s=settings.rollout_timeout_s,
        retry_requests=settings.retry_requests,
        max_attempts=settings.max_attempts,
        route_failures_to_sidecar=settings.route_failures_to_sidecar,
        connect_retries=settings.connect_retries,
        backoff_base_s=settings.retry_backoff_s,
    )


def admissions(
    config: ServersConfig, settings: CollectionSettings, deadline: float | None
) -> dict[str, dict[str, Any]]:
    """The admission payload of each agent's rollouts: the run's caps, its agent's cap, the budget."""
    return {
        name: Admission(
            max_resident_tasks=settings.max_resident_tasks,
            agent_max_concurrency=agent.max_concurrency,
            dispatch_deadline=deadline,
            dispatch_budget_s=settings.dispatch_budget_s if deadline is not None else None,
            drain_margin_s=settings.drain_margin_s,
        ).model_dump(mode="json", exclude_defaults=True)
        for name, agent in config.agents.items()
    }


def enqueue(
    app: Celery,
    opened: OpenedRun,
    rows: Iterator[dict[str, Any]],
    count: int,
    config: ServersConfig,
    settings: CollectionSettings,
    deadline: float | None = None,
) -> str:
    """Publish one collect task per row as a chord with the finish callback; returns the callback's id.

    `deadline` is the dispatch budget's end on the Redis server's clock, when there is a budget.
    """
    finish_id = f"finish-{opened.manifest.run_id}-{opened.run.token[:8]}"
    finish_payload = FinishRequest(run=opened.run).model_dump(mode="json")
    callback = app.signature(FINISH_TASK, args=(finish_payload,), immutable=True)
    callback.set(
        task_id=finish_id,
        shadow=f"{FINISH_TASK}[{opened.manifest.run_id}/{opened.manifest.shard}]",
    )
    if count == 0:
        callback.apply_async()
        return finish_id
    group_id = f"chord-{opened.manifest.run_id}-{opened.run.token[:8]}"
    app.backend.set_chord_size(group_id, count)
    run = opened.run.model_dump(mode="json")
    policy = call_policy(settings).model_dump(mode="json")
    urls = {name: agent.url for name, agent in config.agents.items()}
    gates = admissions(config, settings, deadline)
    run_label = f"{opened.manifest.run_id}/{opened.manifest.shard}"
    queue = app.amqp.queues[QUEUE]
    with app.producer_or_acquire() as producer:
        producer.maybe_declare(queue)
        # One pipelined write per PUBLISH_BATCH messages (kombu's publish batch; immediate on
        # brokers without it), messages built by Celery's own protocol-2 builder, sent through
        # the anonymous exchange to the queue as Celery does for its default queue. send_task
        # per message costs 8x the CPU: a new Redis client and a round trip per message, and
        # an AsyncResult that subscribes and unsubscribes to the result channel.
        with producer.batch(PUBLISH_BATCH):
            for index, row in enumerate(rows):
                rid = F.rollout_id(row)
                agent = F.agent_name(row) or ""
                payload = {
                    "run": run,
                    "agent_url": urls[agent],
                    "policy": policy,
                    "row": row,
                }
                if gates[agent]:
                    payload["admission"] = gates[agent]
                message = app.amqp.as_task_v2(
                    f"{opened.manifest.run_id}.{opened.run.token[:8]}.{rid}",
                    COLLECT_TASK,
                    args=(payload,),
                    kwargs={},
                    group_id=group_id,
                    group_index=index,
                    chord=callback,
                    argsrepr=f"run={opened.manifest.run_id} shard={opened.manifest.shard} rollout={rid}",
                    kwargsrepr="{}",
                    # What Flower and worker logs show as the task's name: which run, which rollout.
                    shadow=f"{COLLECT_TASK}[{run_label} {rid}]",
                    # The chord counts the task without its result being stored; the rare
                    # outcome a caller may read (a drained row) is stored by the task itself.
                    ignore_result=True,
                )
                producer.publish(
                    message.body,
                    exchange="",
                    routing_key=queue.name,
                    serializer="json",
                    headers=message.headers,
                    retry=False,
                    **message.properties,
                )
    return finish_id


def wait_for_finish(
    app: Celery,
    finish_id: str,
    on_progress: Any = None,
    poll_s: float = 0.5,
) -> dict[str, Any]:
    """Block until the finish callback has run; `on_progress()` is called between polls."""
    result = app.AsyncResult(finish_id)
    while True:
        if result.ready():
            value = result.get(propagate=False, disable_sync_subtasks=False)
            if isinstance(value, dict):
                return value
            raise RuntimeError(f"the finish step failed: {value!r}")
        if on_progress is not None:
            on_progress()
        time.sleep(poll_s)
