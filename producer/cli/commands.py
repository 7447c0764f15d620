"""The `rollouts` command line."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
import orjson
from rich.console import Console

from infra.environment import LOCAL_REDIS_URL, from_env, resolve_cluster
from infra.store import RunDir
from producer.cli.errors import reports
from producer.cli.nemo_gym import nemo_gym_spelling
from producer.cli.options import (
    PASS_THROUGH,
    cluster_options,
    events_option,
    fail_on_unhealthy_option,
    local_cluster_options,
    no_wait_option,
    overrides_argument,
    result_backend_options,
    running_shard_options,
    setting_option,
    settings_given,
    shard_options,
)
from producer.cli.overrides import parse_overrides, pop_flag_override
from producer.shard.launch import DEFAULT_CONCURRENCY
from schemas.errors import RolloutsError, UsageError

# Piped (CI logs): lines are not wrapped at 80 columns, so paths and URLs stay whole to copy.
_console = Console(soft_wrap=not sys.stdout.isatty())


@click.group()
def main() -> None:
    """Distributed rollout collection on Celery and Redis."""


@main.command(context_settings=PASS_THROUGH)
@click.option(
    "--config", "config_path", default=None, help="Servers config (YAML; normalised or NeMo Gym's)."
)
@click.option(
    "--input", "input_path", default=None, help="Rows to run (JSONL): a path or an fsspec URL."
)
@click.option("--output-dir", default=None, help="Run directory: a folder or an fsspec URL.")
@click.option("--shard", default=None, help="Shard label.  [default: 0]")
@setting_option("agent_name", "--agent", help="Agent for rows that name none.")
@setting_option("num_repeats", "--num-repeats", type=int, help="Rollouts per task.")
@setting_option(
    "route_failures_to_sidecar",
    "--route-failures-to-sidecar",
    is_flag=True,
    help="Keep going after failed rollouts.",
)
@setting_option(
    "max_resident_tasks",
    "--max-resident-tasks",
    type=int,
    help="Cluster-wide cap on running rollouts.",
)
@setting_option(
    "num_shards",
    "--num-shards",
    type=int,
    help="Split the input into N shards by task number (with --shard-index).",
)
@setting_option(
    "shard_index",
    "--shard-index",
    type=int,
    help="Run the tasks whose number is I modulo N; numbers stay the whole input's. Shard label "
    "default: I.",
)
@local_cluster_options
@cluster_options(
    "Broker URL of a running cluster (else ROLLOUTS_BROKER_URL, else a local cluster).",
    "Redis for locks and results (default: the broker, when it is Redis).",
)
@no_wait_option
@click.option(
    "--overwrite", is_flag=True, help="Replace an earlier run of this shard in the folder."
)
@click.option(
    "--head-server",
    default=None,
    help="A running NeMo Gym head server (http://host:port) to read the servers config from.",
)
@setting_option(
    "allow_unsupported_pairing",
    "--allow-unsupported-pairing",
    is_flag=True,
    help="Skip the allowed_agents checks.",
)
@setting_option(
    "feed",
    "--feed",
    help="Publish the landed rollouts on this feed, a group at a time (see `rollouts feed`).",
)
@events_option
@fail_on_unhealthy_option
@overrides_argument
@reports()
def run(
    config_path: str | None,
    input_path: str | None,
    output_dir: str | None,
    shard: str | None,
    workers: int,
    concurrency: int,
    broker: str | None,
    redis_url: str | None,
    no_wait: bool,
    overwrite: bool,
    head_server: str | None,
    events: bool,
    fail_on_unhealthy: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run every row of INPUT, repeated, across the cluster.

    NeMo Gym's spelling also works: +input_jsonl_fpath=ROWS +output_jsonl_fpath=DIR/rollouts-S.jsonl,
    and with +resume_from_cache=true a shard that exists there is resumed instead.
    """
    from producer.shard.resume import ResumeOptions, execute_resume
    from producer.shard.runner import RunOptions, execute_run

    settings: dict[str, Any] = parse_overrides(list(overrides))
    fail_on_unhealthy = pop_flag_override(settings, "fail_on_unhealthy", fail_on_unhealthy)
    settings.update(settings_given())
    split = settings.get("shard_index")
    if shard is None and isinstance(split, int) and "output_jsonl_fpath" not in settings:
        shard = str(split)  # one shard of a split input: labelled by its index
    spelled = nemo_gym_spelling(settings, input_path, output_dir, shard, _console)
    input_path, output_dir, shard, resume = spelled
    if resume and output_dir is not None:
        sys.exit(
            execute_resume(
                ResumeOptions(
                    output_dir=output_dir, shard=shard, config_path=config_path,
                    head_server=head_server, overrides=settings, workers=workers,
                    concurrency=concurrency, broker_url=broker, redis_url=redis_url,
                    wait=not no_wait, events=events, fail_on_unhealthy=fail_on_unhealthy,
                ),
                _console,
            )
        )  # fmt: skip
    if input_path is None or output_dir is None:
        raise UsageError(
            "run needs --input and --output-dir (or +input_jsonl_fpath and +output_jsonl_fpath)"
        )
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
        events=events,
        fail_on_unhealthy=fail_on_unhealthy,
    )
    sys.exit(execute_run(opts, _console))


@main.command(context_settings=PASS_THROUGH)
@cluster_options(
    f"Broker URL (else ROLLOUTS_BROKER_URL, else {LOCAL_REDIS_URL}).",
    f"Redis for locks and results (default: the broker when it is a Redis, else {LOCAL_REDIS_URL}).",
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
    """Start a worker process (it is `celery -A workers.app worker` with our defaults).

    It joins --broker, else ROLLOUTS_BROKER_URL, else the Redis on 127.0.0.1:6379. Its node name
    is rollouts-<pid>@<host> unless celery's -n/--hostname is given, so workers on one host
    never share one.
    """
    from producer.shard.local_cluster import worker_command, worker_env

    named = any(a in ("-n", "--hostname") or a.startswith("--hostname=") for a in celery_args)
    # exec keeps this process's pid: the worker's own.
    node = None if named else f"rollouts-{os.getpid()}@%h"
    cmd = worker_command(concurrency, loglevel, events, node=node, extra=celery_args)
    env = worker_env(broker, redis_url)
    os.execvpe(cmd[0], cmd, env)


@main.command()
@click.option("--tasks", type=int, default=60, show_default=True, help="Tasks in the demo dataset.")
@click.option("--repeats", type=int, default=4, show_default=True, help="Rollouts per task.")
@click.option("--workers", type=int, default=2, show_default=True, help="Local worker processes.")
@click.option(
    "--output-dir", default=None, help="Run directory (default: a new folder under ./demo-runs)."
)
@reports()
def demo(tasks: int, repeats: int, workers: int, output_dir: str | None) -> None:
    """Run the example agent and environment servers end to end on an embedded cluster."""
    from examples.demo import run_demo

    sys.exit(
        run_demo(
            tasks=tasks,
            repeats=repeats,
            workers=workers,
            output_dir=output_dir,
            console=_console,
        )
    )


@main.command(context_settings=PASS_THROUGH)
@click.argument("run_dir")
@click.option(
    "--shard",
    default=None,
    help="Shard label.  [default: 0; with --plan, every shard in RUN_DIR]",
)
@click.option(
    "--max-attempts",
    type=int,
    default=None,
    help="Attempt limit per rollout (else NEMO_GYM_MAX_ROLLOUT_ATTEMPTS, else the run's).",
)
@click.option(
    "--extend-retries",
    type=int,
    default=None,
    metavar="N",
    help="Raise the attempt limit by N: exhausted rollouts get a new budget.",
)
@click.option(
    "--plan",
    "plan_only",
    is_flag=True,
    help="Print every expected rollout's recovery state and write the coverage; run nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="With --plan: print the plan as JSON.")
@click.option("--config", "config_path", default=None, help="Servers config (default: the run's).")
@local_cluster_options
@cluster_options(
    "Broker URL (else ROLLOUTS_BROKER_URL, else local).", "Redis for locks and results."
)
@no_wait_option
@events_option
@fail_on_unhealthy_option
@overrides_argument
@reports()
def resume(
    run_dir: str,
    shard: str | None,
    max_attempts: int | None,
    extend_retries: int | None,
    plan_only: bool,
    as_json: bool,
    config_path: str | None,
    workers: int,
    concurrency: int,
    broker: str | None,
    redis_url: str | None,
    no_wait: bool,
    events: bool,
    fail_on_unhealthy: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run the planned rollouts of RUN_DIR that have no outcome yet (retryable and missing), then
    finish the shard. Exit 0 complete, 1 failed or rejected, 75 a partial result saved again."""
    from producer.shard.resume import ResumeOptions, execute_plan, execute_resume

    if as_json and not plan_only:
        raise UsageError("--json needs --plan")
    settings = parse_overrides(list(overrides))
    fail_on_unhealthy = pop_flag_override(settings, "fail_on_unhealthy", fail_on_unhealthy)
    opts = ResumeOptions(
        output_dir=run_dir, shard=shard or "0", max_attempts=max_attempts, config_path=config_path,
        overrides=settings, workers=workers, concurrency=concurrency,
        broker_url=broker, redis_url=redis_url, wait=not no_wait, events=events,
        fail_on_unhealthy=fail_on_unhealthy, as_json=as_json, extend_retries=extend_retries,
    )  # fmt: skip
    if plan_only:
        sys.exit(execute_plan(opts, _console, shard))
    sys.exit(execute_resume(opts, _console))


@main.command()
@shard_options
@click.option("--watch", is_flag=True, help="Live progress until the shard finishes.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="--watch refresh.")
@running_shard_options
@reports()
def status(
    run_dir: str,
    shard: str,
    watch: bool,
    as_json: bool,
    interval: float,
    broker: str | None,
    redis_url: str | None,
) -> None:
    """Planned, landed, failed by class, in flight, queued, rate and ETA, by agent and environment."""
    from producer.ops.control import find_redis_url, load_manifest, unknown_redis
    from producer.ops.status import StatusReader, exit_code, print_status
    from producer.ops.status import watch as watch_status

    rd = RunDir(run_dir)
    manifest = load_manifest(rd, shard)
    reader = StatusReader(rd, shard, find_redis_url(rd, manifest, redis_url, broker))
    if reader.redis_url is None and manifest.state == "running":
        reader.live_error = unknown_redis(manifest)
    if watch:
        report = watch_status(_console, reader, interval)
    elif as_json:
        report = reader.report()
    else:
        report = print_status(_console, reader)
    if as_json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    if watch:
        # Re-attached to a run (its producer may be gone): end as the run does.
        sys.exit(exit_code(report))


@main.command()
@click.argument("name")
@click.option("--consumer", default="cli", show_default=True, help="Consumer name (one per rank).")
@click.option("--ack", is_flag=True, help="Acknowledge each group once written.")
@click.option(
    "--ack-id", "ack_id", multiple=True, help="Acknowledge this entry id and exit (repeatable)."
)
@click.option("--follow", is_flag=True, help="Keep reading after the feed's run closed it.")
@click.option(
    "--claim-after-s", type=float, default=60.0, show_default=True,
    help="Take over another consumer's groups unacknowledged this long.",
)  # fmt: skip
@cluster_options("Broker URL, when it is the feed's Redis.", "The feed's Redis.")
@reports()
def feed(
    name: str,
    consumer: str,
    ack: bool,
    ack_id: tuple[str, ...],
    follow: bool,
    claim_after_s: float,
    broker: str | None,
    redis_url: str | None,
) -> None:
    """Tail feed NAME as JSONL, one group per line, for trainers in any language."""
    import asyncio

    from producer.api.feed import Feed, ack_ids, tail

    url = redis_url or broker or from_env().redis_url or from_env().broker_url
    if not url:
        raise UsageError("feed needs a Redis: pass --redis or set ROLLOUTS_REDIS_URL")
    reader = Feed(name, url, claim_after_s=claim_after_s)

    def out(line: bytes) -> None:
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()

    async def go() -> None:
        try:
            if ack_id:
                flags = await ack_ids(reader, list(ack_id), consumer)
                for entry, took in zip(ack_id, flags, strict=True):
                    out(
                        orjson.dumps({"id": entry, "acked": took}, option=orjson.OPT_APPEND_NEWLINE)
                    )
            else:
                await tail(reader, consumer, out, ack, follow)
        finally:
            await reader.aclose()

    asyncio.run(go())


@main.command()
@shard_options
@click.option("--drain", is_flag=True, help="Let running rollouts finish; start no new ones.")
@running_shard_options
@reports()
def cancel(
    run_dir: str, shard: str, drain: bool, broker: str | None, redis_url: str | None
) -> None:
    """Stop a running shard: nothing new starts; running /run calls are cancelled unless --drain."""
    from producer.ops.control import cancel_shard, find_redis_url, load_manifest

    rd = RunDir(run_dir)
    manifest = load_manifest(rd, shard)
    _console.print(cancel_shard(rd, shard, find_redis_url(rd, manifest, redis_url, broker), drain))


@main.command(context_settings=PASS_THROUGH)
@result_backend_options
@click.option("--port", type=int, default=5555, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True)
@click.option(
    "--unauthenticated-api",
    is_flag=True,
    help="Serve Flower's HTTP API without auth (sets FLOWER_UNAUTHENTICATED_API); else use --basic-auth.",
)
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@reports()
def flower(
    broker: str | None,
    redis_url: str | None,
    port: int,
    address: str,
    unauthenticated_api: bool,
    flower_args: tuple[str, ...],
) -> None:
    """Start Flower against the cluster's broker; rollout tasks show as rollouts.collect with args
    `run=RUN shard=S rollout=ID`.

    Flower switches task events on in every worker it reaches; `rollouts worker --events` and
    `rollouts run --events` start workers with them on from the first task.
    """
    from producer.ops.control import check_flower_exposure, flower_command

    cluster = resolve_cluster(broker, redis_url)
    if cluster is None:
        raise UsageError("flower needs --broker URL (or ROLLOUTS_BROKER_URL)")
    env = dict(os.environ)
    # Through the environment, never argv: `ps` would show the URL's password.
    env["ROLLOUTS_BROKER_URL"] = env["CELERY_BROKER_URL"] = cluster.broker_url
    env["ROLLOUTS_REDIS_URL"] = cluster.redis_url
    if unauthenticated_api:
        env["FLOWER_UNAUTHENTICATED_API"] = "true"
    check_flower_exposure(address, list(flower_args), env)
    cmd = flower_command(port, address, list(flower_args))
    os.execvpe(cmd[0], cmd, env)


@main.command("capture-proxy")
@click.option("--upstream", required=True, help="The model server's base URL (OpenAI-compatible).")
@click.option(
    "--capture-dir", required=True, help="model_call_capture_dir: a folder or fsspec URL."
)
@click.option("--port", type=int, default=9400, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--model-name",
    default="policy_model",
    show_default=True,
    help="The model_ref name recorded on each call (NeMo Gym's model server name).",
)
@reports()
def capture_proxy(upstream: str, capture_dir: str, port: int, host: str, model_name: str) -> None:
    """Capture model calls as NeMo Gym does: agents call `http://HOST:PORT/ng-rollout/<rollout
    id>/v1/...`; each call is forwarded to UPSTREAM and recorded in `<id>.capture.jsonl`."""
    from infra.capture_proxy import serve

    if not upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream must be an http(s) URL, got {upstream!r}")
    serve(upstream, capture_dir, host, port, model_name)


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
@click.option(
    "--model-call-capture-dir",
    "capture_dir",
    default=None,
    metavar="URL",
    help="Read failed rollouts' model calls here (timeouts section); default: the run's own.",
)
@result_backend_options
@fail_on_unhealthy_option
@reports(RolloutsError)
def health_check(
    run_dir: str,
    rollouts_file: str | None,
    limits: tuple[str, ...],
    ignore: str | None,
    as_json: bool,
    distributed: bool,
    capture_dir: str | None,
    broker: str | None,
    redis_url: str | None,
    fail_on_unhealthy: bool,
) -> None:
    """Recheck RUN_DIR from its persisted artifacts and write its health reports."""
    from producer.ops.recheck import health_check as run_check
    from producer.ops.recheck import parse_limits

    cluster = resolve_cluster(broker, redis_url)
    sys.exit(
        run_check(
            run_dir,
            rollouts_file=rollouts_file,
            limits=parse_limits(limits),
            ignore=ignore,
            as_json=as_json,
            distributed=distributed,
            broker_url=cluster.broker_url if cluster else None,
            redis_url=cluster.redis_url if cluster else None,
            console=_console,
            fail_on_unhealthy=fail_on_unhealthy,
            capture_dir=capture_dir,
        )
    )


@main.command("report")
@click.argument("run_dir")
@click.option(
    "--output", "-o", default=None, help="The HTML file to write (default: RUN_DIR/report.html)."
)
@reports(RolloutsError)
def report(run_dir: str, output: str | None) -> None:
    """Write RUN_DIR's report: one HTML file that needs no network to open."""
    from producer.ops.report import report as write

    sys.exit(write(run_dir, output, _console))


@main.command("compare")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--output", "-o", default=None, help="Also write the comparison as an HTML file.")
@reports(RolloutsError)
def compare(run_a: str, run_b: str, output: str | None) -> None:
    """Is RUN_B better than RUN_A? Paired bootstrap over their shared tasks, per environment."""
    from producer.ops.compare import compare as run_compare

    sys.exit(run_compare(run_a, run_b, output, _console))


@main.command("aggregate")
@click.option(
    "--input-glob", "-i", required=True, help="Shards to merge (comma-separated glob patterns)."
)
@click.option("--output", "-o", required=True, help="The merged rollouts file to write.")
@click.option("--config", "config_path", default=None, help="Servers config (default: manifests).")
@click.option("--ignore", default=None, metavar="A,B", help="Health check ids to skip.")
@click.option("--no-health-check", is_flag=True, help="Skip the health check.")
@click.option(
    "--separate-datasets",
    is_flag=True,
    help="The shards are different inputs: (task, rollout) identities may repeat across them.",
)
@reports(RolloutsError)
def aggregate(
    input_glob: str,
    output: str,
    config_path: str | None,
    ignore: str | None,
    no_health_check: bool,
    separate_datasets: bool,
) -> None:
    """Merge shards sorted by (task, rollout), aggregate their metrics, check their health."""
    from producer.ops.aggregate import aggregate as run_aggregate

    sys.exit(
        run_aggregate(
            input_glob,
            output,
            config_path=config_path,
            ignore=ignore,
            health=not no_health_check,
            console=_console,
            separate_datasets=separate_datasets,
        )
    )
