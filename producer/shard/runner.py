"""`rollouts run`: plan, open, enqueue, wait, report; on a given cluster or on a local one."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from infra import keys, telemetry
from infra.redis_client import client
from infra.store import ShardFiles
from producer.config.loading import load_run_config
from producer.config.overrides import resolve_settings
from producer.planning.materialize import PlannedShard, plan_shard
from producer.shard.celery_client import client_app
from producer.shard.cluster import named_cluster
from producer.shard.dispatch import ShardDispatch, dispatch_generation
from producer.shard.launch import LaunchOptions
from producer.shard.local_cluster import LocalCluster
from producer.shard.opening import iter_materialized, open_planned
from producer.shard.report import print_counts, print_health, print_metrics, raise_if_unhealthy
from producer.shard.stop import Stopped, counted, stop_on_sigterm, stop_run
from producer.shard.supervise import raise_for_outcome
from schemas.config import ServersConfig
from schemas.finish import FinishResult
from schemas.settings import CollectionSettings
from workers.shard.state import set_planned_by_agent


@dataclass
class RunOptions(LaunchOptions):
    """Everything `rollouts run` was asked to do."""

    config_path: str | None
    input_path: str
    output_dir: str
    shard: str = "0"
    settings: dict[str, Any] = field(default_factory=dict)
    overwrite: bool = False
    head_server: str | None = None
    """A running NeMo Gym head server to read the servers config from, instead of config_path."""


def dispatch_and_wait(
    planned: PlannedShard,
    opts: RunOptions,
    broker_url: str,
    redis_url: str,
    console: Console,
    config: ServersConfig,
    local: bool = False,
) -> FinishResult | None:
    """Open the planned shard on this cluster, enqueue its chord and, unless `--no-wait`, wait."""
    opened = open_planned(planned, redis_url, broker_url=broker_url, local=local)
    groups: Counter[tuple[str | None, str | None]] = Counter()
    try:
        with stop_on_sigterm():
            settings = CollectionSettings.model_validate(opened.manifest.settings)
            sid = keys.shard_id(opened.rd.url, opened.manifest.shard)

            def planned_by_agent(counts: Counter[tuple[str | None, str | None]]) -> None:
                by_agent: Counter[str | None] = Counter()
                for (agent, _), n in counts.items():
                    by_agent[agent] += n
                set_planned_by_agent(client(redis_url), sid, dict(by_agent))

            rows = counted(
                iter_materialized(opened.rd, opened.manifest.shard), groups, planned_by_agent
            )
            app = client_app(broker_url, redis_url)
            to = ShardDispatch(app, redis_url, opened, config, settings)
            inputs = ShardFiles(opened.manifest.shard).materialized
            return dispatch_generation(
                to, rows, opened.manifest.planned, console, wait=opts.wait, inputs=inputs
            )
    except Stopped:
        # Stopped while enqueueing: the per-group counts are partial, so fractions are unknown.
        complete = sum(groups.values()) == opened.manifest.planned
        raise stop_run(opened, redis_url, groups if complete else None, console) from None


def execute_run(opts: RunOptions, console: Console | None = None) -> int:
    """Run to the end and return the exit code; raises UsageError for bad input (exit 2)."""
    console = console or Console()
    config = load_run_config(opts.config_path, opts.head_server)
    # Round-robin across agents unless told otherwise: one slow agent's rows do not queue up
    # behind each other at the head of the run (the Python API keeps the rows' order).
    settings = resolve_settings(None, {"interleave_by_agent": True, **opts.settings})
    if settings.telemetry_enabled:  # before a local cluster starts: its workers trace too
        telemetry.request()
    # Before the run directory is touched: a cluster that does not answer is exit 2, nothing written.
    named = named_cluster(opts.broker_url, opts.redis_url)
    planned = plan_shard(
        input_path=opts.input_path,
        output_dir=opts.output_dir,
        shard=opts.shard,
        config=config,
        settings=settings,
        overwrite=opts.overwrite,
    )
    if named is not None:
        result = dispatch_and_wait(
            planned, opts, named.broker_url, named.redis_url, console, config
        )
    else:
        console.print(f"starting an embedded Redis and {opts.workers} local worker processes")
        shard = (planned.rd.url, planned.manifest.shard)
        with LocalCluster(
            opts.workers, opts.concurrency, events=opts.events, shard=shard
        ) as cluster:
            result = dispatch_and_wait(
                planned, opts, cluster.url, cluster.url, console, config, local=True
            )
    console.print(f"run directory: {planned.rd.url}")
    if result is None:
        return 0
    print_metrics(console, planned.rd, planned.manifest.shard)
    print_health(console, result.health, result.report)
    print_counts(console, result)
    raise_for_outcome(result)
    raise_if_unhealthy(result.health, opts.fail_on_unhealthy, "--fail-on-unhealthy")
    return 0
