"""Waiting for a dispatched generation of a shard: progress, stalls, the final verdict.

The producer waits for the chord's callback (the finish step). That callback never comes when the
chord's state or the queued tasks are gone (Redis restarted empty) or when workers died holding
tasks (the broker redelivers those only after its visibility timeout, hours later). So the wait
also watches for a *stall*: no progress, no rollout of this run running or waiting for a slot, no
finish step running and nothing in the queue, for `stall_timeout_s`. A stalled run is marked
failed and the producer exits 1 saying how to resume it; `rollouts resume` then runs exactly
what is missing. `poll_finish` is the one poll of the finish step's result: `wait_for_shard`
hangs its progress display and stall detection on it, `wait_for_finish` (tests, bench) nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import KombuError
from pydantic import JsonValue
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from infra import keys
from infra.environment import from_env
from infra.redis_client import client
from infra.runs import read_manifest, write_manifest, write_status
from producer.shard.cost import CostWatch, cost_reason
from producer.shard.live import LiveSnapshot, broker_queue_length, snapshot
from producer.shard.opening import OpenedRun
from schemas.errors import RunFailedError, RunPartialError
from schemas.finish import FinishResult
from schemas.health import STOPPED_BY_SIGTERM
from schemas.settings import CollectionSettings
from workers.shard.ledger import count_shard
from workers.shard.reservations import Reservations
from workers.shard.state import refresh_shard_keys

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a waiting producer reads the run's progress and looks for a stall."""
LOOK_S = 0.05
"""How often it looks at the finish step's result (one GET): a run returns within this of its
finish, not within `POLL_S`."""
WARN_EVERY_S = 30.0
KEYS_REFRESH_S = 60.0
"""How often a waiting producer pushes its shard keys' expiry on (`refresh_shard_keys`)."""


READ_ERRORS = (redis.RedisError, KombuError, OSError)
"""What a poll of Redis or the broker raises while either is unreachable for a moment."""


def poll_finish(
    app: Celery,
    finish_id: str,
    between: Callable[[], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    poll_s: float = POLL_S,
    look_s: float = LOOK_S,
) -> Any:
    """Poll the finish step's result until it is ready and return its value (or what it raised).

    The one wait for a chord's callback. The result is looked at every `look_s`; `between()`
    runs after a look that found it not ready, at most every `poll_s` (progress, stall
    detection); `on_error(exc)` gets a failed look (else it is raised).
    """
    result = app.AsyncResult(finish_id)
    due = time.monotonic()
    while True:
        try:
            if result.ready():
                return result.get(propagate=False, disable_sync_subtasks=False)
        except READ_ERRORS as exc:
            if on_error is None:
                raise
            on_error(exc)
        if between is not None and time.monotonic() >= due:
            between()
            due = time.monotonic() + poll_s
        time.sleep(min(look_s, poll_s))


def wait_for_shard(
    app: Celery,
    opened: OpenedRun,
    redis_url: str,
    settings: CollectionSettings,
    console: Console,
    finish_id: str,
    count: int,
    refill: Callable[[], object] | None = None,
) -> FinishResult:
    """Wait for the finish step, showing progress; raise RunFailedError when the run stalls.

    `refill`: called at each poll (the queue window's, `workers/window.py`)."""
    r = client(redis_url)
    sid = keys.shard_id(opened.rd.url, opened.manifest.shard)
    last_signature: tuple[Any, ...] | None = None
    last_activity = time.monotonic()
    last_warning = 0.0
    last_refresh = time.monotonic()
    cost = CostWatch.of(opened.rd, opened.manifest.shard, settings)

    def warn(exc: Exception) -> None:
        nonlocal last_warning
        if time.monotonic() - last_warning > WARN_EVERY_S:
            console.print(f"[yellow]cannot read the run's state from Redis: {exc}[/]")
            last_warning = time.monotonic()

    def watch() -> None:
        nonlocal last_signature, last_activity, last_refresh
        try:
            snap = snapshot(r, sid)
            now = time.monotonic()
            if now - last_refresh > KEYS_REFRESH_S:
                # While the producer waits, the run is alive: its keys' expiry moves on.
                pipe = r.pipeline(transaction=False)
                refresh_shard_keys(pipe, sid, opened.run.token)
                pipe.execute()
                last_refresh = now
        except READ_ERRORS as exc:
            warn(exc)
            return
        if refill is not None:
            try:
                refill()
            except Exception as exc:  # the workers refill it too
                warn(exc)
        if cost is not None and cost.check(now):
            r.set(keys.shard_cancel(sid), "drain", ex=from_env().live_key_ttl_s)
            reason = cost_reason(cost.cost, cost.limit)
            console.print(f"[yellow]dispatch {reason}; running rollouts finish, no other starts[/]")
        _show(progress, bar, snap)
        signature = snap.signature()
        if signature != last_signature or snap.active:
            last_signature, last_activity = signature, now
        elif now - last_activity > settings.stall_timeout_s:
            queued = broker_queue_length(app)
            if queued:
                # Messages are waiting (ours, or another run's ahead of ours).
                last_activity = now
            else:
                progress.stop()
                raise stalled(opened, settings, queued, snap.silent_holders())

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("landed {task.fields[landed]} · failure rows {task.fields[failed]} · "
                   "in flight {task.fields[in_flight]}{task.fields[unstarted]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:  # fmt: skip
        bar = progress.add_task(
            "rollouts", total=count, landed=0, failed=0, in_flight=0, unstarted=""
        )
        value = poll_finish(app, finish_id, between=watch, on_error=warn)
        with contextlib.suppress(redis.RedisError):
            _show(progress, bar, snapshot(r, sid))
    if isinstance(value, dict):
        result = FinishResult.model_validate(value)
        if cost is not None and cost.passed and result.cancelled:
            raise cost_stopped(opened, cost)
        return result
    raise RunFailedError(
        f"the finish step of {opened.rd.url} shard {opened.manifest.shard} failed: {value!r}; "
        f"resume it with: rollouts resume {opened.rd.url} --shard {opened.manifest.shard}"
    )


def _show(progress: Progress, bar: Any, snap: LiveSnapshot) -> None:
    failed = sum(v for k, v in snap.shard_counts.items() if k.startswith("failed:"))
    fields: dict[str, Any] = {"in_flight": snap.in_flight}
    if snap.token is not None:  # else Redis lost the generation's counters: keep the last view
        fields["completed"] = snap.resolved
        fields["unstarted"] = unstarted_text(snap.counters)
    if snap.shard_counts:
        fields.update(landed=snap.shard_counts.get("landed", 0), failed=failed)
    progress.update(bar, **fields)


def unstarted_text(counters: dict[str, int]) -> str:
    """The resolved rollouts that neither landed nor failed (so the bar's count adds up)."""
    parts = [
        f"{label} {counters[key]}"
        for key, label in (
            ("cancelled", "cancelled"),
            ("drained", "drained"),
            ("stopped", "not started"),
        )
        if counters.get(key)
    ]
    return "".join(f" · {part}" for part in parts)


def stalled(
    opened: OpenedRun,
    settings: CollectionSettings,
    queued: int | None,
    silent: list[str] | None = None,
) -> RunFailedError:
    """Mark a stalled run failed (with its counts from storage) and say how to resume it;
    `silent`: the worker processes whose rollout leases expired."""
    rd, shard = opened.rd, opened.manifest.shard
    counts = count_shard(rd, shard, Reservations(opened.manifest.generations))
    failed = sum(counts.failed.values())
    missing = max(0, counts.planned - counts.landed - failed)
    message = (
        f"the run stalled: {counts.landed} of {counts.planned} rollouts landed, {failed} failed, "
        f"{missing} have no outcome, and for {settings.stall_timeout_s:g}s nothing of this run "
        "was running, waiting or queued"
        + ("" if queued is not None else " (the broker's queue length was unknown)")
        + ". Workers died holding its tasks or the broker lost its messages (e.g. Redis "
        "restarted)"
        + (f"; holders that went silent: {', '.join(silent)}" if silent else "")
        + ". Resume it to run what is missing: "
        f"rollouts resume {rd.url} --shard {shard}"
    )
    manifest = read_manifest(rd, shard)
    if manifest.token == opened.run.token:
        write_status(rd, counts.status(manifest.run_id, shard))
        manifest.state = "failed"
        manifest.error = message
        write_manifest(rd, manifest)
    return RunFailedError(message)


def cost_stopped(opened: OpenedRun, cost: CostWatch) -> RunFailedError:
    """The drained run's manifest says why; exit 1 with how to run the rest."""
    manifest = read_manifest(opened.rd, opened.manifest.shard)
    manifest.error = f"dispatch {cost_reason(cost.cost, cost.limit)}"
    write_manifest(opened.rd, manifest)
    return RunFailedError(
        f"the run's {manifest.error}; `rollouts resume {opened.rd.url} --shard "
        f"{opened.manifest.shard} +max_cost_usd=N` runs the rest"
    )


def raise_for_outcome(result: FinishResult) -> None:
    """Exit 75 (RunPartialError) for a partial result a resume can complete; exit 1
    (RunFailedError) for a failed, cancelled, rejected or unaggregated run; else nothing (0)."""
    if result.partial:
        raise RunPartialError(partial_message(result))
    if result.run_error:
        message = f"the run failed: {result.run_error}"
        if result.rejection:
            message += f"\n{result.rejection}"
        raise RunFailedError(message)
    if result.rejection:
        raise RunFailedError(result.rejection)
    if result.cancelled:
        raise RunFailedError(
            f"the run was cancelled: {result.landed}/{result.planned} rollouts "
            "landed; `rollouts resume` runs the rest"
        )
    if result.state == "failed":
        raise RunFailedError(f"the run failed: {result.error}")
    if result.aggregation_error:
        raise RunFailedError(f"aggregation failed: {result.aggregation_error}")


def partial_message(result: FinishResult) -> str:
    """Why a partial run stopped, and what a resume runs."""
    coverage = result.run_coverage
    left = f"; {coverage.runnable} rollouts can still run" if coverage is not None else ""
    if result.rejection:
        return result.rejection
    if result.run_error == STOPPED_BY_SIGTERM:
        why = "stopped by SIGTERM"
    elif result.cancelled == "drain":
        why = "drained by `rollouts cancel --drain`"
    else:
        why = f"drained by its dispatch budget ({result.drained} rollouts not started)"
    return (
        f"partial result saved: the run was {why}; {result.landed}/{result.planned} rollouts "
        f"landed{left}; `rollouts resume` runs the rest (exit 75: requeue it)"
    )


def exit_code_of(result: FinishResult) -> int:
    """The exit code a finished run ends with (0 done, 1 failed or rejected, 75 partial)."""
    try:
        raise_for_outcome(result)
    except RunFailedError as exc:
        return exc.exit_code
    return 0


def wait_for_finish(
    app: Celery,
    finish_id: str,
    on_progress: Callable[[], None] | None = None,
    poll_s: float = POLL_S,
    look_s: float = LOOK_S,
) -> dict[str, JsonValue]:
    """Block until the finish callback has run; `on_progress()` is called between polls."""
    value = poll_finish(app, finish_id, between=on_progress, poll_s=poll_s, look_s=look_s)
    if isinstance(value, dict):
        return value
    raise RuntimeError(f"the finish step failed: {value!r}")
