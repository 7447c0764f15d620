"""The `rollouts` command line."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from producer.overrides import parse_overrides
from producer.runner import DEFAULT_CONCURRENCY, DEFAULT_WORKERS, RunOptions, execute_run
from schemas.errors import RolloutsError, RunFailedError, UsageError

_console = Console()
_errors = Console(stderr=True)


def _fail(exc: RolloutsError) -> None:
    # Escaped: messages quote names like [simple_agent] that rich would read as markup.
    message = escape(str(exc))
    _errors.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    code = getattr(exc, "exit_code", 1)
    sys.exit(code)


@click.group()
def main() -> None:
    """Distributed rollout collection on Celery and Redis."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--config", "config_path", default=None, help="Servers config (YAML; normalised or NeMo Gym's)."
)
@click.option("--input", "input_path", required=True, help="Rows to run (JSONL).")
@click.option("--output-dir", required=True, help="Run directory: a folder or an fsspec URL.")
@click.option("--shard", default="0", show_default=True, help="Shard label.")
@click.option("--agent", default=None, help="Agent for rows that name none.")
@click.option("--num-repeats", type=int, default=None, help="Rollouts per task.")
@click.option(
    "--route-failures-to-sidecar",
    is_flag=True,
    default=None,
    help="Keep going after failed rollouts.",
)
@click.option(
    "--max-resident-tasks", type=int, default=None, help="Cluster-wide cap on running rollouts."
)
@click.option(
    "--workers",
    type=int,
    default=DEFAULT_WORKERS,
    show_default=True,
    help="Local worker processes (without --broker).",
)
@click.option(
    "--concurrency",
    type=int,
    default=DEFAULT_CONCURRENCY,
    show_default=True,
    help="Rollouts in flight per local worker.",
)
@click.option(
    "--broker",
    default=None,
    help="Broker URL of a running cluster (else ROLLOUTS_BROKER_URL, else a local cluster).",
)
@click.option(
    "--redis",
    "redis_url",
    default=None,
    help="Redis for locks and results (default: the broker, when it is Redis).",
)
@click.option("--no-wait", is_flag=True, help="Enqueue and return.")
@click.option(
    "--overwrite", is_flag=True, help="Replace an earlier run of this shard in the folder."
)
@click.option(
    "--head-server",
    default=None,
    help="A running NeMo Gym head server (http://host:port) to read the servers config from.",
)
@click.option(
    "--allow-unsupported-pairing",
    is_flag=True,
    default=None,
    help="Skip the allowed_agents checks.",
)
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def run(
    config_path: str | None,
    input_path: str,
    output_dir: str,
    shard: str,
    agent: str | None,
    num_repeats: int | None,
    route_failures_to_sidecar: bool | None,
    max_resident_tasks: int | None,
    workers: int,
    concurrency: int,
    broker: str | None,
    redis_url: str | None,
    no_wait: bool,
    overwrite: bool,
    head_server: str | None,
    allow_unsupported_pairing: bool | None,
    overrides: tuple[str, ...],
) -> None:
    """Run every row of INPUT, repeated, across the cluster."""
    try:
        settings: dict[str, Any] = parse_overrides(list(overrides))
        for key, value in (
            ("agent_name", agent),
            ("num_repeats", num_repeats),
            ("route_failures_to_sidecar", route_failures_to_sidecar),
            ("max_resident_tasks", max_resident_tasks),
            ("allow_unsupported_pairing", allow_unsupported_pairing),
        ):
            if value is not None:
                settings[key] = value
        opts = RunOptions(
            config_path=config_path,
            input_path=input_path,
            output_dir=output_dir,
            shard=shard,
            settings=settings,
            overwrite=overwrite,
            workers=workers,
            concurrency=concurrency,
            broker_url=broker,
            redis_url=redis_url,
            wait=not no_wait,
            head_server=head_server,
        )
        sys.exit(execute_run(opts, _console))
    except (UsageError, RunFailedError) as exc:
        _fail(exc)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--broker", default=None, help="Broker URL (else ROLLOUTS_BROKER_URL).")
@click.option(
    "--redis", "redis_url", default=None, help="Redis for locks and results (default: the broker)."
)
@click.option(
    "--concurrency",
    type=int,
    default=DEFAULT_CONCURRENCY,
    show_default=True,
    help="Rollouts in flight.",
)
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--events", is_flag=True, help="Send task events (for Flower).")
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(
    broker: str | None,
    redis_url: str | None,
    concurrency: int,
    loglevel: str,
    events: bool,
    celery_args: tuple[str, ...],
) -> None:
    """Start a worker process (it is `celery -A workers.app worker` with our defaults)."""
    env = dict(os.environ)
    if broker:
        env["ROLLOUTS_BROKER_URL"] = broker
    if redis_url:
        env["ROLLOUTS_REDIS_URL"] = redis_url
    cmd = [
        sys.executable, "-m", "celery", "--quiet", "-A", "workers.app", "worker",
        "-P", "threads", "-c", str(concurrency), "-Q", "rollouts", "-l", loglevel,
    ]  # fmt: skip
    if events:
        cmd.append("-E")
    cmd.extend(celery_args)
    os.execvpe(cmd[0], cmd, env)


@main.command()
@click.option("--tasks", type=int, default=60, show_default=True, help="Tasks in the demo dataset.")
@click.option("--repeats", type=int, default=4, show_default=True, help="Rollouts per task.")
@click.option("--workers", type=int, default=2, show_default=True, help="Local worker processes.")
@click.option(
    "--output-dir", default=None, help="Run directory (default: a new folder under ./demo-runs)."
)
def demo(tasks: int, repeats: int, workers: int, output_dir: str | None) -> None:
    """Run the example agent and environment servers end to end on an embedded cluster."""
    from examples.demo import run_demo

    try:
        sys.exit(
            run_demo(
                tasks=tasks,
                repeats=repeats,
                workers=workers,
                output_dir=output_dir,
                console=_console,
            )
        )
    except (UsageError, RunFailedError) as exc:
        _fail(exc)


@main.command("health-check")
@click.argument("run_dir")
@click.option("--rollouts-file", default=None, help="Check this rollouts file alone.")
@click.option(
    "--limit",
    "limits",
    multiple=True,
    metavar="NAME=VALUE",
    help="Override a persisted limit (max_failed_rollouts, max_failed_fraction; =none removes).",
)
@click.option("--ignore", default=None, metavar="A,B", help="Check ids to skip.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as compact JSON.")
@click.option(
    "--distributed", is_flag=True, help="Run the recheck as Celery jobs on the cluster's workers."
)
@click.option("--broker", default=None, help="Broker URL (else ROLLOUTS_BROKER_URL).")
@click.option("--redis", "redis_url", default=None, help="Result backend (default: the broker).")
def health_check(
    run_dir: str,
    rollouts_file: str | None,
    limits: tuple[str, ...],
    ignore: str | None,
    as_json: bool,
    distributed: bool,
    broker: str | None,
    redis_url: str | None,
) -> None:
    """Recheck RUN_DIR from its persisted artifacts and write its health reports."""
    from producer.recheck import health_check as run_check
    from producer.recheck import parse_limits

    try:
        sys.exit(
            run_check(
                run_dir,
                rollouts_file=rollouts_file,
                limits=parse_limits(limits),
                ignore=ignore,
                as_json=as_json,
                distributed=distributed,
                broker_url=broker or os.environ.get("ROLLOUTS_BROKER_URL"),
                redis_url=redis_url or os.environ.get("ROLLOUTS_REDIS_URL"),
                console=_console,
            )
        )
    except RolloutsError as exc:
        _fail(exc)


@main.command("aggregate")
@click.option(
    "--input-glob", "-i", required=True, help="Shards to merge (comma-separated glob patterns)."
)
@click.option("--output", "-o", required=True, help="The merged rollouts file to write.")
@click.option("--config", "config_path", default=None, help="Servers config (default: manifests).")
@click.option("--ignore", default=None, metavar="A,B", help="Health check ids to skip.")
@click.option("--no-health-check", is_flag=True, help="Skip the health check.")
def aggregate(
    input_glob: str,
    output: str,
    config_path: str | None,
    ignore: str | None,
    no_health_check: bool,
) -> None:
    """Merge shards sorted by (task, rollout), aggregate their metrics, check their health."""
    from producer.recheck import aggregate as run_aggregate

    try:
        sys.exit(
            run_aggregate(
                input_glob,
                output,
                config_path=config_path,
                ignore=ignore,
                health=not no_health_check,
                console=_console,
            )
        )
    except RolloutsError as exc:
        _fail(exc)


if __name__ == "__main__":
    main()
