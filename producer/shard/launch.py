"""The options `rollouts run` and `rollouts resume` share: the cluster a shard runs on, whether
the command waits for it, and whether an unhealthy verdict fails the command."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_WORKERS = 2
DEFAULT_CONCURRENCY = 256


@dataclass(kw_only=True)
class LaunchOptions:
    """The cluster (`broker_url`/`redis_url`, else a local one of `workers` processes running
    `concurrency` rollouts each) and how the command ends."""

    workers: int = DEFAULT_WORKERS
    concurrency: int = DEFAULT_CONCURRENCY
    broker_url: str | None = None
    redis_url: str | None = None
    wait: bool = True
    events: bool = False
    """Local workers send task events (for Flower)."""
    fail_on_unhealthy: bool = False
    """Exit 1 when the finished shard's health verdict is UNHEALTHY."""
