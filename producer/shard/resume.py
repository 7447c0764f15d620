"""`rollouts resume`: enqueue exactly the planned rollouts that still lack an outcome
(docs/how-to/resume-and-recovery.md).

Every expected rollout has one of NeMo Gym's nine recovery states, read from storage alone
(`producer/shard/plan.py`); a resume runs exactly the `retryable` ones (a failure below the
attempt limit, not terminal, not a judge failure that kept the agent's answer, not settled as
a scored zero) and the `missing` ones (no outcome of their newest reserved execution: never
run, drained, stopped, killed). Each is sent with `_ng_attempt_index` set to its failed attempts
so far. A rollout that left no row at all runs again even with `count_missing_rollouts_as_zero`:
as in NeMo Gym, that zero stands in for it in the metrics only. `--extend-retries N` raises the
attempt limit by N, so `exhausted` rollouts get a new budget. The resume opens a new dispatch
generation (a fresh opener token, fencing out whatever the earlier generation still has
running) that records the rollouts it reserves before any is dispatched, and its finish step
aggregates the whole shard: old and new results. `--plan` prints the states and writes the
coverage, dispatching nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from rich.console import Console

from infra import jsonl, keys, telemetry
from infra.redis_client import client
from infra.runs import read_manifest, recorded_finish
from infra.store import RunDir, ShardFiles
from producer.config.loading import load_run_config
from producer.config.overrides import resolve_settings
from producer.planning.ordering import in_run_order
from producer.shard.celery_client import client_app
from producer.shard.cluster import RECORDED_BROKER, recorded_cluster
from producer.shard.dispatch import ShardDispatch, dispatch_generation
from producer.shard.launch import LaunchOptions
from producer.shard.local_cluster import LocalCluster
from producer.shard.opening import OpenedRun, record_opening
from producer.shard.plan import ResumePlan, plan_resume, plan_targets, rows_to_run, show_plan
from producer.shard.report import print_counts, print_health, print_metrics, raise_if_unhealthy
from producer.shard.supervise import raise_for_outcome
from schemas import fields as F
from schemas.config import ServersConfig, masked_paths, redact_url
from schemas.errors import StorageError, UsageError
from schemas.finish import FinishResult
from schemas.records import Manifest
from schemas.settings import DEFAULT_MAX_ATTEMPTS, CollectionSettings
from workers.shard.coverage import RecoveryPolicy
from workers.shard.state import open_shard

MAX_ATTEMPTS_ENV = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"
# Settings that shape the planned rollouts: fixed once the materialized inputs exist.
PLANNING_SETTINGS = frozenset(
    {
        "agent_name", "agent_map", "fan_out", "num_repeats", "task_ids", "limit",
        "interleave_repeats", "interleave_by_agent", "allow_unsupported_pairing",
        "num_shards", "shard_index", "skills", "num_repeats_add_seed",
        "environment_routing_mode", "environment_server_name", "environment_server_routes",
    }
)  # fmt: skip


@dataclass
class ResumeOptions(LaunchOptions):
    """Everything `rollouts resume` was asked to do."""

    output_dir: str
    shard: str = "0"
    max_attempts: int | None = None
    config_path: str | None = None
    head_server: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    as_json: bool = False
    """`--plan --json`: the plan as JSON."""
    extend_retries: int | None = None
    """Raise the attempt limit by this many: `exhausted` rollouts get a new budget."""


def max_attempts_limit(flag: int | None, settings: CollectionSettings, console: Console) -> int:
    """`--max-attempts`, else NEMO_GYM_MAX_ROLLOUT_ATTEMPTS, else the run's own setting."""
    if flag is not None:
        if flag < 1:
            raise UsageError(f"--max-attempts must be >= 1, got {flag}")
        return flag
    raw = os.environ.get(MAX_ATTEMPTS_ENV)
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value >= 1:
            return value
        console.print(
            f"[yellow]warning:[/] {MAX_ATTEMPTS_ENV}={raw!r} is not an integer >= 1; "
            f"using {DEFAULT_MAX_ATTEMPTS}"
        )
        return DEFAULT_MAX_ATTEMPTS
    return settings.max_attempts


def verify_materialized(rd: RunDir, manifest: Manifest) -> None:
    """Refuse a shard whose materialized inputs are not the ones its manifest recorded."""
    files = ShardFiles(manifest.shard)
    if not rd.exists(files.materialized):
        raise UsageError(f"{rd.path(files.materialized)}: missing; this shard cannot be resumed")
    digest = hashlib.sha256()
    for _, block in rd.iter_bytes(files.materialized):
        digest.update(block)
    if digest.hexdigest() != manifest.materialized_sha256:
        raise UsageError(
            f"{rd.path(files.materialized)}: its SHA-256 differs from the one in "
            f"{files.manifest}; the planned rollouts changed since the run was planned, "
            "so it cannot be resumed"
        )


def by_target(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """`rows` round-robin across the servers their `/run` goes to (`interleave_by_agent`, spilled
    to temporary files past a memory budget as planning does)."""
    planned = ((0, F.dispatch_target(row) or "", orjson.dumps(row) + b"\n") for row in rows)
    for line in in_run_order(planned, interleave_by_agent=True):
        yield orjson.loads(line)


def written(
    rd: RunDir, name: str, rows: Iterator[dict[str, Any]], count: int
) -> Iterator[dict[str, Any]]:
    """Write `rows` to the run directory's file `name` (replaced whole) and return them as read
    back from it: the file a windowed resume publishes from, a window at a time
    (`workers/window.py`)."""
    n = 0
    with rd.writing(name) as out:
        for row in rows:
            out.write(jsonl.dumps_line(row))
            n += 1
    if n != count:
        raise StorageError(f"{rd.path(name)}: {n} rows to run written, {count} planned")
    return (row for _, row in rd.iter_objects(name) if row is not None)


def resume_settings(
    manifest: Manifest, overrides: dict[str, Any], console: Console
) -> tuple[CollectionSettings, dict[str, Any]]:
    """The run's settings with this resume's overrides; planning settings cannot change."""
    ignored = sorted(
        k for k, v in overrides.items() if k in PLANNING_SETTINGS and manifest.settings.get(k) != v
    )
    if ignored:
        console.print(
            f"[yellow]note:[/] ignoring {', '.join(ignored)} on resume: the planned rollouts "
            "are fixed by the materialized inputs"
        )
    changed = {k: v for k, v in overrides.items() if k not in PLANNING_SETTINGS}
    settings = resolve_settings(manifest.settings, changed)
    return settings, changed


def open_resume(
    rd: RunDir, shard: str, redis_url: str, enqueued: int, settings: CollectionSettings,
    overrides: dict[str, Any], broker_url: str | None = None, local: bool = False,
    reserved: str | None = None,
) -> OpenedRun:  # fmt: skip
    """Record a new generation (with the rollouts it `reserved`, before any is dispatched) and
    hand the shard's Redis state to its token, under the shard lock."""
    r = client(redis_url)
    sid = keys.shard_id(rd.url, shard)
    opened = record_opening(
        rd, read_manifest(rd, shard), kind="resume", enqueued=enqueued, redis_url=redis_url,
        settings=settings, overrides=overrides, broker_url=broker_url, local=local,
        reserved=reserved,
    )  # fmt: skip
    # The shard's Redis state rebuilt from storage under its lock, with the new token as opener:
    # the earlier generation's tasks are fenced out from here.
    open_shard(r, rd, shard)
    r.delete(keys.shard_run_failed(sid), keys.shard_cancel(sid), keys.shard_waiting(sid))
    return opened


def standing_finish(rd: RunDir, manifest: Manifest) -> FinishResult | None:
    """The last finish step's result, when finishing again could change nothing: it finished the
    current generation completed, and the shard's results and failure rows are the bytes it read
    (`infra.runs.recorded_finish`). None otherwise."""
    if manifest.state != "completed":
        return None
    return recorded_finish(rd, manifest, manifest.token)


def _check_agents(rd: RunDir, shard: str, plan: ResumePlan, config: ServersConfig) -> None:
    missing: Counter[str] = Counter()
    for row in rows_to_run(rd, shard, plan):
        target = F.dispatch_target(row) or ""
        servers = config.environments if F.is_task_row(row) else config.agents
        if target not in servers:
            missing[target] += 1
    if missing:
        names = ", ".join(f"{a!r} ({n} rollouts)" for a, n in sorted(missing.items()))
        raise UsageError(
            f"the config has no agent or environment server {names}; pass --config with them"
        )


def saved_config(rd: RunDir, saved: dict[str, Any]) -> ServersConfig:
    """The servers config the manifest saved, when it can call the agents as it is: a saved config
    whose secrets were masked (`***`) would send the mask instead of the secret."""
    masked = masked_paths(saved)
    if masked:
        raise UsageError(
            f"{rd.url}: the saved servers config has masked secrets ({', '.join(masked[:5])}"
            f"{', ...' if len(masked) > 5 else ''}); pass the config again with --config FILE "
            "(or --head-server URL) to resume"
        )
    return ServersConfig.model_validate(saved)


def resume_policy(
    opts: ResumeOptions, settings: CollectionSettings, console: Console
) -> tuple[CollectionSettings, int]:
    """The settings with this resume's attempt limit (`--max-attempts`, the environment, the
    run's; raised by `--extend-retries`), and that limit."""
    max_attempts = max_attempts_limit(opts.max_attempts, settings, console)
    if opts.extend_retries is not None:
        if opts.extend_retries < 1:
            raise UsageError(f"--extend-retries must be >= 1, got {opts.extend_retries}")
        max_attempts += opts.extend_retries
    if max_attempts != settings.max_attempts:
        settings = settings.model_copy(update={"max_attempts": max_attempts})
    return settings, max_attempts


def execute_plan(opts: ResumeOptions, console: Console, shard: str | None) -> int:
    """`rollouts resume --plan`: the states and coverage of the shard, else of every shard of
    the folder (or of the shards a merged folder's record lists); nothing is dispatched."""
    targets = plan_targets(RunDir(opts.output_dir), shard)

    def judged_by(manifest: Manifest) -> RecoveryPolicy:
        settings, _ = resume_settings(manifest, opts.overrides, Console(quiet=True))
        return RecoveryPolicy.of(resume_policy(opts, settings, console)[0])

    return show_plan(console, targets, judged_by, opts.as_json)


def execute_resume(opts: ResumeOptions, console: Console | None = None) -> int:
    """Resume a shard to the end and return the exit code; UsageError (exit 2) for bad input."""
    console = console or Console()
    rd = RunDir(opts.output_dir)
    try:
        manifest = read_manifest(rd, opts.shard)
    except StorageError as exc:
        raise UsageError(str(exc)) from None
    verify_materialized(rd, manifest)
    # Before anything is written: the named or recorded cluster answers, or exit 2.
    named = recorded_cluster(manifest, opts.broker_url, opts.redis_url)
    overrides = dict(opts.overrides)
    # Fixed for the planned order; for what a resume re-enqueues, on unless turned off here.
    interleave = overrides.pop("interleave_by_agent", True)
    if not isinstance(interleave, bool):
        raise UsageError(f"+interleave_by_agent must be true or false, got {interleave!r}")
    settings, changed = resume_settings(manifest, overrides, console)
    if settings.telemetry_enabled:  # before a local cluster starts: its workers trace too
        telemetry.request()
    settings, max_attempts = resume_policy(opts, settings, console)
    if max_attempts != manifest.settings.get("max_attempts"):
        changed["max_attempts"] = max_attempts
    config = (
        load_run_config(opts.config_path, opts.head_server)
        if opts.config_path or opts.head_server
        else saved_config(rd, manifest.config)
    )
    # Finishing again repeats the last finish when nothing would run and nothing it reads changed:
    # the same files, config and settings.
    same = not changed and not (opts.config_path or opts.head_server)
    standing = standing_finish(rd, manifest) if same else None
    if standing is not None and standing.landed == standing.planned == manifest.planned:
        # Every planned rollout landed, in the files as they are: nothing to read to know it.
        console.print(
            f"resuming {manifest.run_id} shard {opts.shard}: {manifest.planned} planned, all "
            "landed; running 0"
        )
        to_run, plan = 0, None
    else:
        plan = plan_resume(rd, opts.shard, RecoveryPolicy.of(settings), manifest)
        to_run = plan.to_run
        if to_run:
            _check_agents(rd, opts.shard, plan, config)
        console.print(f"resuming {manifest.run_id} shard {opts.shard}: {plan.line()}")
    if to_run == 0 and standing is not None:
        console.print(
            f"nothing to run; shard {opts.shard}'s last finish ({manifest.updated_at}) read "
            "these same files, so its aggregate metrics, health and report stand (an override "
            "or --config finishes it again)"
        )
        console.print(f"run directory: {rd.url}")
        return _print_finished(console, rd, opts, standing)
    assert plan is not None or to_run == 0
    reserved = plan.reserved() if plan is not None else None

    def go(broker: str, redis_url: str, local: bool = False) -> FinishResult | None:
        opened = open_resume(
            rd, opts.shard, redis_url, to_run, settings, changed, broker, local, reserved
        )
        to = ShardDispatch(client_app(broker, redis_url), redis_url, opened, config, settings)
        rows = rows_to_run(rd, opts.shard, plan) if plan is not None else iter(())
        if interleave:
            rows = by_target(rows)
        inputs = None
        if settings.queue_window and to_run:
            inputs = ShardFiles(opts.shard).resume_inputs
            rows = written(rd, inputs, rows, to_run)
        return dispatch_generation(to, rows, to_run, console, wait=opts.wait, inputs=inputs)

    if named is not None:
        if named.broker_from == RECORDED_BROKER:
            console.print(f"resuming on the run's cluster: broker {redact_url(named.broker_url)}")
        result = go(named.broker_url, named.redis_url)
    else:
        was_local = manifest.generations and manifest.generations[-1].local
        local = " (the run was local; pass --broker URL for a cluster)" if was_local else ""
        console.print(
            f"starting an embedded Redis and {opts.workers} local worker processes{local}"
        )
        shard = (rd.url, opts.shard)
        with LocalCluster(
            opts.workers, opts.concurrency, events=opts.events, shard=shard
        ) as cluster:
            result = go(cluster.url, cluster.url, local=True)
    console.print(f"run directory: {rd.url}")
    if result is None:
        return 0
    return _print_finished(console, rd, opts, result)


def _print_finished(console: Console, rd: RunDir, opts: ResumeOptions, result: FinishResult) -> int:
    print_metrics(console, rd, opts.shard)
    print_health(console, result.health, result.report)
    print_counts(console, result)
    raise_for_outcome(result)
    raise_if_unhealthy(result.health, opts.fail_on_unhealthy, "--fail-on-unhealthy")
    return 0
