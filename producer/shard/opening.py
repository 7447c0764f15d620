"""Opening a shard: planned inputs, the manifest and its generation, clean Redis state.

`plan_shard` plans the input into the materialized inputs; `open_planned` then writes the manifest
with its first generation, once, when the Redis it coordinates through is known (`open_run` does
both). `new_manifest` and `record_opening` are the one builder of a manifest and of the generation
that opens a shard, for a fresh run, a resume and a recorded API call; `reset_shard_state` gives
a fresh shard Redis state that names the opener token. The materialized inputs are read back,
row by row, by `iter_materialized`; a generation records its Redis as `redact_url` shows it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis

from infra import jsonl, keys
from infra.runs import maybe_manifest, write_manifest
from infra.store import RunDir, ShardFiles
from producer.planning.labels import shard_label_problem
from producer.planning.planner import PlanContext, WarningSink, write_plan
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem, RunExistsError, StorageError
from schemas.messages import RunRef
from schemas.records import Generation, InputSource, Manifest, utc_now
from schemas.settings import CollectionSettings
from workers.shard.state import write_state


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


@dataclass
class PlannedShard:
    """A fresh shard whose materialized inputs are on storage; its manifest is not written yet."""

    rd: RunDir
    manifest: Manifest
    """The manifest to write, without a generation."""


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


def new_manifest(
    *,
    run_id: str,
    shard: str,
    input: InputSource,
    config: ServersConfig,
    settings: CollectionSettings,
    planned: int,
    materialized_sha256: str,
) -> Manifest:
    """A fresh shard's manifest, before the generation that opens it (`record_opening`)."""
    return Manifest(
        run_id=run_id,
        shard=shard,
        created_at=utc_now(),
        input=input,
        config=config.redacted(),
        settings=settings.model_dump(mode="json"),
        planned=planned,
        materialized_sha256=materialized_sha256,
    )


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
) -> OpenedRun:
    """Append the generation that opens the shard now and write the manifest, once.

    The one place a shard's opening is recorded: a fresh run, a resume and a recorded API call.
    The generation names the Redis it coordinates through (redacted), so `rollouts status` and
    `cancel` find it. The shard is running again; a resume records the `settings` it runs with
    and the `overrides` that changed them.
    """
    token = token or new_token()
    manifest.state = "running"
    manifest.error = None
    if settings is not None:
        manifest.settings = settings.model_dump(mode="json")
    manifest.generations.append(
        Generation(
            token=token,
            kind=kind,
            started_at=utc_now(),
            enqueued=enqueued,
            redis_url=redact_url(redis_url) if redis_url is not None else None,
            overrides=overrides or {},
        )
    )
    write_manifest(rd, manifest)
    run = RunRef(run_id=manifest.run_id, output_dir=rd.url, shard=manifest.shard, token=token)
    return OpenedRun(rd, manifest, run)


def plan_shard(
    *,
    input_path: str,
    output_dir: str,
    shard: str,
    config: ServersConfig,
    settings: CollectionSettings,
    overwrite: bool = False,
    on_warning: WarningSink | None = None,
) -> PlannedShard:
    """Plan the input and write the materialized inputs; no manifest is written, nothing enqueued.

    Every problem (the shard label, the run directory, every input row) is raised in one error
    before the run directory is touched.
    """
    problems: list[Problem] = []
    label_problem = shard_label_problem(shard, field="shard", flag="--shard")
    label_ok = label_problem is None
    if label_problem is not None:
        problems.append(label_problem)
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
    manifest = new_manifest(
        run_id=run_id,
        shard=shard,
        input=InputSource(path=os.path.abspath(input_path), sha256=sha256_file(input_path)),
        config=config,
        settings=settings,
        planned=plan.planned,
        materialized_sha256=plan.sha256,
    )
    return PlannedShard(rd, manifest)


def open_planned(
    planned: PlannedShard, redis_url: str | None = None, token: str | None = None
) -> OpenedRun:
    """Write a planned shard's manifest with its first generation (`kind` run), once."""
    return record_opening(
        planned.rd, planned.manifest, kind="run", enqueued=planned.manifest.planned,
        redis_url=redis_url, token=token,
    )  # fmt: skip


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


def redact_url(url: str) -> str:
    """`url` with any password replaced, for the manifest."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
