"""A worker process's real rollout context: the engine's collaborators wired to this process.

The engine (`workers/rollout/`) takes its collaborators as one `RolloutContext`; here they are
made once per process (and again after a fork): the admission gate, the lander, the `/run`
caller on the process's event loop, the manifest check, and the rollout leases, which publish
the rollouts they take over through the worker's Celery app. The app is imported here, on the
Celery side, so nothing in the engine's package imports it.
"""

from __future__ import annotations

from infra.environment import from_env
from infra.http import process_io
from infra.process import PerProcess
from infra.redis_client import client
from workers.app import app
from workers.feed.backpressure import FeedGate
from workers.redispatch import publisher, unacked_sweep
from workers.rollout.admission import gate
from workers.rollout.context import (
    WAIT_REFRESH_S,
    AgentCaller,
    Blocking,
    RolloutContext,
    StepThreads,
    StopWatch,
    WaitingLines,
)
from workers.rollout.landing import lander
from workers.rollout.leases import RolloutLeases
from workers.shard.trust import ManifestCheck
from workers.window import QueueWindow

BLOCKING_THREADS = 4
"""Threads per process for the engine's blocking steps: each is a Redis round trip or a
storage read of ~1 ms, a few per rollout; a Redis outage parks them in its retries. More
threads cost more than they hide: with 16 (and 8 finishing threads) a worker made 85 context
switches per rollout, 38% of its CPU in the kernel, and ran 0.77x the rate of 4 (and 2)."""


def _real_context(redis_url: str) -> RolloutContext:
    io = process_io()
    admission = gate(redis_url)
    blocking = Blocking(StepThreads(BLOCKING_THREADS, "rollouts-step"))
    return RolloutContext(
        gate=admission,
        lander=lander(redis_url),
        agent=AgentCaller(lambda: io.http, StopWatch(admission.stop_reason, blocking)),
        loop=io.loop,
        blocking=blocking,
        leases=_leases.get(redis_url),
        runs=ManifestCheck(),
        # Within a lease TTL, a waiting entry asked again before it expires.
        lines=WaitingLines(min(WAIT_REFRESH_S, from_env().lease_ttl_s / 3)),
        feeds=FeedGate(admission.r),
    )


def _real_leases(redis_url: str) -> RolloutLeases:
    publish = publisher(app)
    ttl_s = from_env().lease_ttl_s
    found = unacked_sweep(app, redis_url, publish, ttl_s)
    # One round trip per interval renews both kinds of lease the process holds.
    slots = gate(redis_url).renewer.adopt(ttl_s)
    return RolloutLeases(
        redis_url,
        publish=publish,
        ttl_s=ttl_s,
        sweep=found.sweep if found else None,
        slots=slots,
        window=QueueWindow(app, client(redis_url)),
    )


_leases: PerProcess[str, RolloutLeases] = PerProcess(_real_leases)


_contexts: PerProcess[str, RolloutContext] = PerProcess(_real_context)


def process_context(redis_url: str) -> RolloutContext:
    """This process's context for the Redis at `redis_url`, made on first use (after any fork)."""
    return _contexts.get(redis_url)
