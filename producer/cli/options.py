"""The option groups several commands share, each declared once; the order they add options in is
the order `--help` shows them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from producer.shard.launch import DEFAULT_CONCURRENCY, DEFAULT_WORKERS

C = TypeVar("C", bound=Callable[..., Any])

PASS_THROUGH: dict[str, Any] = {"ignore_unknown_options": True, "allow_extra_args": True}
"""Context settings of a command whose trailing arguments are its own (`+key=value`, celery's)."""

overrides_argument = click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
"""`+key=value ...`: collection settings, NeMo Gym style (`producer/config/overrides.py`)."""

SETTINGS_GIVEN = "rollouts.settings_given"
"""Where `setting_option`s keep what they were given (`click.Context.meta`)."""


def setting_option(setting: str, *decls: str, **attrs: Any) -> Callable[[C], C]:
    """An option that sets the collection setting `setting`, over a `+setting=value` override;
    left off (its default is None, a flag's too) it sets nothing. The command reads the values
    given with `settings_given`."""

    def given(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            ctx.meta.setdefault(SETTINGS_GIVEN, {})[param.name] = (setting, value)

    return click.option(*decls, default=None, expose_value=False, callback=given, **attrs)


def settings_given() -> dict[str, Any]:
    """The settings the current command's `setting_option`s were given, in declaration order."""
    ctx = click.get_current_context()
    given = ctx.meta.get(SETTINGS_GIVEN, {})
    return dict(given[p.name] for p in ctx.command.params if p.name in given)


no_wait_option = click.option("--no-wait", is_flag=True, help="Enqueue and return.")
events_option = click.option(
    "--events", is_flag=True, help="Local workers send task events (for Flower)."
)

fail_on_unhealthy_option = click.option(
    "--fail-on-unhealthy",
    is_flag=True,
    help="Exit 1 when the health verdict is UNHEALTHY (also +fail_on_unhealthy=true).",
)


def local_cluster_options(command: C) -> C:
    """`--workers` and `--concurrency`: the local cluster a command starts without `--broker`."""
    command = click.option(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        show_default=True,
        help="Rollouts in flight per local worker.",
    )(command)
    return click.option(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        show_default=True,
        help="Local worker processes (without --broker).",
    )(command)


def cluster_options(broker_help: str, redis_help: str) -> Callable[[C], C]:
    """`--broker` and `--redis` (as `redis_url`), with what each means to the command."""

    def decorate(command: C) -> C:
        command = click.option("--redis", "redis_url", default=None, help=redis_help)(command)
        return click.option("--broker", default=None, help=broker_help)(command)

    return decorate


running_shard_options = cluster_options(
    "Broker URL, when it is the run's Redis.", "The run's Redis (default: recorded)."
)
"""`--broker` and `--redis` of a command that finds a running shard's Redis (status, cancel)."""

result_backend_options = cluster_options(
    "Broker URL (else ROLLOUTS_BROKER_URL).", "Result backend (default: the broker)."
)
"""`--broker` and `--redis` of a command that runs Celery jobs and reads their results."""


def shard_options(command: C) -> C:
    """RUN_DIR and `--shard`: the shard of a run directory a command works on."""
    command = click.option("--shard", default="0", show_default=True, help="Shard label.")(command)
    return click.argument("run_dir")(command)
