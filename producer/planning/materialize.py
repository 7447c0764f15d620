"""Planning a fresh shard: check the run directory, plan the input, write the materialized inputs.

`plan_shard` is the first step of `rollouts run`: every problem (the shard label, a run directory
whose shard belongs to an earlier run, every input row) is raised in one error before the run
directory is touched; on success the materialized inputs are on storage and the shard is ready to
be opened (`producer/shard/opening.py` writes its manifest once its cluster is known).
`new_manifest` is the one builder of a shard's manifest (a fresh run's here, a recorded API
call's in `producer/api/record.py`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime

from infra.runs import maybe_manifest
from infra.store import RunDir, ShardFiles
from producer.config.facts import run_facts
from producer.planning.inputs import InputFile
from producer.planning.labels import shard_label_problem
from producer.planning.planner import PlanContext, WarningSink, write_plan
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem, RunExistsError, StorageError
from schemas.records import InputSource, Manifest, utc_now
from schemas.settings import CollectionSettings


def new_run_id() -> str:
    """A fresh run id: the UTC time and a random suffix."""
    return f"run-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


@dataclass
class PlannedShard:
    """A fresh shard whose materialized inputs are on storage; its manifest is not written yet."""

    rd: RunDir
    manifest: Manifest
    """The manifest to write, without a generation (`producer/shard/opening.py` adds it)."""


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
        config_facts=run_facts(config, settings),
    )


def shard_artifacts_present(rd: RunDir, shard: str) -> list[str]:
    """The files of shard `shard` already in the run directory."""
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
    source = InputFile(input_path)
    try:
        found = source.exists()
    except PlanningError as exc:
        raise PlanningError([*problems, *exc.problems, *([existing] if existing else [])]) from None
    if not found:
        problems.append(Problem("input file not found", file=source.name))
        raise PlanningError([*problems, *([existing] if existing else [])])
    run_id = new_run_id()
    files = ShardFiles(shard)
    tmpdir = tempfile.mkdtemp(prefix="rollouts-plan-")
    try:
        local = os.path.join(tmpdir, "materialized_inputs.jsonl")
        try:
            plan = write_plan(
                source,
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
            raise PlanningError([Problem("no rows to run", file=source.name)])
        rd.makedirs()
        if overwrite:
            for name in present:
                rd.remove(name)
            rd.remove_folder(files.superseded)
        if rd.is_local:
            shutil.move(local, rd.path(files.materialized))
        else:
            rd.fs.put_file(local, rd.path(files.materialized))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    manifest = new_manifest(
        run_id=run_id,
        shard=shard,
        input=InputSource(path=source.name, sha256=source.sha256),
        config=config,
        settings=settings,
        planned=plan.planned,
        materialized_sha256=plan.sha256,
    )
    return PlannedShard(rd, manifest)
