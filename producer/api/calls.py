"""The Python API for trainers that drive dispatch themselves (docs/reference/python-api.md), over the Celery cluster.

    rows = preprocess_examples(raw_rows, config, settings)
    completions = run_examples(rows, config, max_resident_tasks=64)
    try:
        for future in completions:
            row, result = await future
            if enough(row, result):
                break
    finally:
        await completions.aclose()

Each row is one Celery task (`rollouts.collect_reply`) run by the ordinary workers; outcomes
come back on one Redis list per call as they land (`producer/api/transport.py`), and the
awaitables resolve in completion order (`producer/api/completions.py`).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from infra import keys
from infra.environment import Cluster, resolve_cluster
from infra.reachability import check_cluster
from infra.redis_client import client
from producer.api.completions import Completions, Convert, Pair, Settled
from producer.api.feed import feed_plan
from producer.api.model import Outcome, Target
from producer.api.record import open_recorded_shard
from producer.api.rows import Stamp, prepare_rows
from producer.api.transport import Invocation
from producer.config.loading import (
    load_head_server_config,
    load_servers_config,
    parse_servers_config,
)
from producer.config.overrides import resolve_settings
from producer.planning.materialize import new_run_id
from producer.shard.celery_client import client_app
from producer.shard.dispatch import open_generation
from producer.shard.opening import new_token
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import RolloutFailedError, ShardFencedError, UsageError
from schemas.messages import RunRef
from schemas.outcomes import (
    FAILURE_ENDS,
    NOT_STARTED,
    RESULT_ENDS,
    Ended,
    RolloutFailureRecord,
    run_failure_message,
)
from schemas.settings import CollectionSettings

DEFAULT_CLOSE_TIMEOUT_S = 30.0
INVOCATION_DIR = "rollouts-api://"
RUN_ERROR = "run_error"
"""The key of a failure row (`record_unrouted_failures`) that holds the error it stands for."""
"""Unrecorded calls keep their admission state under a shard id derived from this and the call."""


@dataclass(frozen=True)
class Call:
    """How one call dispatches, besides its collection settings."""

    enrich: bool
    records: bool
    """Failures and drained rows become `RolloutFailureRecord`s (`run_outcomes`)."""
    record_output_dir: str | os.PathLike[str] | None = None
    record_shard: str = "0"
    record_overwrite: bool = False
    run_id: str | None = None
    broker_url: str | None = None
    redis_url: str | None = None
    close_timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S
    result_timeout_s: float | None = None
    record_unrouted_failures: bool = False
    """A failed `/run` not routed to the sidecar resolves to its failure row holding the error
    as `run_error`, instead of raising it."""
    record_omitted_rollouts: bool = False
    """A recorded call's rows that the close left without an outcome get `_ng_omitted` rows."""


def _config(config: ServersConfig | Mapping[str, Any] | str | os.PathLike[str]) -> ServersConfig:
    """The servers: a config, a mapping in either format, a YAML path, or the URL of a NeMo Gym
    head server (`http://host:port`), whose config is fetched."""
    if isinstance(config, ServersConfig):
        return config
    if isinstance(config, str) and config.startswith(("http://", "https://")):
        return load_head_server_config(config)
    if isinstance(config, str | os.PathLike):
        return load_servers_config(Path(config))
    return parse_servers_config(dict(config), "<config>")


def _settings(
    base: CollectionSettings | Mapping[str, Any] | None, **options: Any
) -> CollectionSettings:
    # An option left at its default keeps what `base` says; one set to something else wins.
    defaults = CollectionSettings.model_fields
    return resolve_settings(base, {k: v for k, v in options.items() if v != defaults[k].default})


API_NAMES = {"--broker": "broker_url=", "--redis": "redis_url="}
"""The API's names for what the CLI calls flags, in its error messages."""


def _urls(broker_url: str | None, redis_url: str | None) -> tuple[str, str]:
    """The cluster's broker and Redis, checked once per process (as `rollouts run` checks them,
    before anything is dispatched or written): a UsageError names the argument and address."""
    cluster = resolve_cluster(broker_url, redis_url)
    if cluster is None:
        raise UsageError("run_examples needs a broker: pass broker_url= or set ROLLOUTS_BROKER_URL")
    cluster = dataclasses.replace(
        cluster,
        broker_from=API_NAMES.get(cluster.broker_from, cluster.broker_from),
        redis_from=API_NAMES.get(cluster.redis_from, cluster.redis_from),
    )
    if cluster not in _checked:
        check_cluster(cluster)
        _checked.add(cluster)
    return cluster.broker_url, cluster.redis_url


_checked: set[Cluster] = set()


def _converter(
    rows: list[dict[str, Any]], settings: CollectionSettings, call: Call, run_id: str | None,
    call_run_id: str,
) -> Convert:  # fmt: skip
    """How an outcome becomes what its awaitable returns or raises."""
    route = settings.route_failures_to_sidecar
    typed = call.records or call.enrich

    def record(i: int, failure: dict[str, Any]) -> RolloutFailureRecord:
        stamped = rows[i].get(F.RUN_ID)
        rid = run_id or (stamped if isinstance(stamped, str) and stamped else call_run_id)
        return RolloutFailureRecord.from_failure_row(failure, rid, f"row-{i}")

    def convert(o: Outcome) -> Settled:
        row = rows[o.index]
        if o.kind in RESULT_ENDS:
            result = o.result or {}
            if call.enrich and o.perf is not None:
                result = {**result, "ng_perf": {**(result.get("ng_perf") or {}), **o.perf}}
            return Settled(o.kind, value=(row, result))
        if o.kind in NOT_STARTED:
            drained = o.result or {}
            return Settled(
                o.kind, value=(row, record(o.index, drained) if call.records else drained)
            )
        if o.kind in FAILURE_ENDS:
            failure = o.result or {}
            if route:
                return Settled(o.kind, value=(row, record(o.index, failure) if typed else failure))
            message = run_failure_message(F.rollout_id(row) or o.index, failure)
            error = RolloutFailedError(message, row, failure)
            if call.record_unrouted_failures:
                # The caller keeps the evidence (the row, and the error it would have raised).
                return Settled(o.kind, value=(row, {**failure, RUN_ERROR: error}))
            return Settled(o.kind, error=error)
        if o.kind == Ended.CANCELLED:
            return Settled(o.kind)
        if o.kind == Ended.FENCED:
            return Settled(o.kind, error=ShardFencedError(o.error or "the shard was fenced"))
        if o.timed_out:
            return Settled(o.kind, error=TimeoutError(o.error))
        message = f"rollout {F.rollout_id(row) or o.index} could not be run: {o.error}"
        error = RolloutFailedError(message, row)
        error.__cause__ = o.cause
        return Settled(o.kind, error=error)

    return convert


class CallOptions(TypedDict, total=False):
    """The keyword options of `run_examples` and `run_outcomes`; each one left out takes the
    default named here."""

    max_resident_tasks: int | None
    """At most that many rows running or queued at once; publishing starts when the first
    awaitable is awaited. None (default): every row is enqueued when iteration starts."""
    dispatch_budget_s: float | None
    """No row starts later than this after the call (sooner by `drain_margin_s`); such a row
    resolves to the drained row. None (default): no budget."""
    drain_margin_s: float | None
    """Stop starting this long before the budget ends. None (default): the p75 of the call's
    successful durations once there are 5."""
    retry_requests: bool
    """Replay a `/run` that failed after it was sent (timeouts, resets, 429/502/503/504);
    connections never established are retried regardless. Default True."""
    enrich_results: bool
    """Results carry `ng_perf` (`rollout_latency_ms`, `queue_wait_ms`), and routed failures
    come back as `RolloutFailureRecord`s. Default False."""
    include_model_call_payloads: bool
    """With model-call capture on (`observability_enabled`, `model_call_capture_dir` in
    `settings`), keep the calls' request and response bodies in `ng_trajectory`; off, the
    trajectory keeps its structure, timings and token counts only. Default True."""
    delete_model_call_capture: bool
    """Delete each rollout's capture files once merged into its result (needs the payloads
    kept). Default False."""
    record_output_dir: str | os.PathLike[str] | None
    """Also write shard `record_shard` of that run directory as `rollouts run` would
    (materialized inputs, manifest, results and failure rows, status; when the call ends or
    closes, the aggregate metrics and health summary), so `rollouts status`, `resume` and
    `health-check` work on it. The rows need their planned identity. Implies
    `enrich_results`. None (default): nothing is persisted."""
    record_shard: str
    """The shard `record_output_dir` gets. Default "0"."""
    record_overwrite: bool
    """Replace an existing recorded shard instead of refusing it. Default False."""
    settings: CollectionSettings | Mapping[str, Any] | None
    """Any other collection setting (`rollout_timeout_s`, `max_attempts`, health limits, ...);
    an option here that is not left at its default wins over it."""
    run_id: str | None
    """The run the rows belong to, stamped on copies as `_ng_run_id` (overriding a row's own);
    None (default): a row's stamp is kept, and unstamped rows share the call's id."""
    broker_url: str | None
    """Default `ROLLOUTS_BROKER_URL`."""
    redis_url: str | None
    """Default `ROLLOUTS_REDIS_URL`, else the broker."""
    close_timeout_s: float
    """How long a close waits for running rollouts to stop. Default 30."""
    result_timeout_s: float | None
    """A row without an outcome that long after it was sent resolves to `TimeoutError` naming
    its rollout (the rollout is not cancelled; the other rows go on). None (default): no
    caller-side deadline; a dead or cut-off worker's rows are taken over within the lease TTL
    and a third of it."""
    record_omitted_rollouts: bool
    """With `record_output_dir`, the rows a close left without an outcome (never started, or
    cancelled in flight) get `_ng_omitted` rows in the sidecar: intentional omissions,
    completed samples for strict completion, never run by a resume. Default False."""


_SETTING_OPTIONS = (
    "max_resident_tasks", "dispatch_budget_s", "drain_margin_s", "retry_requests",
    "include_model_call_payloads", "delete_model_call_capture",
)  # fmt: skip
"""The options that are collection settings of the same name."""
_CALL_OPTIONS = tuple(
    f.name for f in dataclasses.fields(Call) if f.name not in ("enrich", "records")
)
"""The options that are `Call` fields of the same name."""


def run_examples(
    rows: Iterable[dict[str, Any]],
    config: ServersConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    route_failures_to_sidecar: bool = False,
    record_unrouted_failures: bool = False,
    **options: Unpack[CallOptions],
) -> Completions:
    """Dispatch each row as one Celery task; returns an iterator of awaitables of `(row, result)`.

    The awaitables resolve in completion order. Rows are sent as given (call
    `preprocess_examples` first for routing and repeats); rows that name only a `task_source`
    get their agent (rows `preprocess_examples` planned without a config among them), and every
    problem is raised at once (PlanningError) before anything is sent. `config`: a
    `ServersConfig`, a mapping in either format, a YAML path, or a NeMo Gym head server's URL.
    `row` is the row as it was sent: a copy the call owns (never the caller's object, which is
    never modified), with what the call stamped on it; `result` is the `/run` result with the
    row's identity fields (as it lands), an agent's own failure row included.

    - `route_failures_to_sidecar`: a failed `/run` resolves to its failure row; off, its
      awaitable raises `RolloutFailedError` (carrying the failure row) and the rest go on.
    - `record_unrouted_failures`: with `route_failures_to_sidecar` off, a failed `/run` resolves
      to its failure row with the `RolloutFailedError` it would raise under `run_error`, so the
      caller keeps the evidence before it raises; without it the awaitable raises.
    - `options`: the `CallOptions` (budget, resident tasks, recording, cluster, timeouts).
    """
    return _start(
        "run_examples", rows, config, options, records=False, route=route_failures_to_sidecar,
        record_unrouted_failures=record_unrouted_failures,
    )  # fmt: skip


def _dispatch(
    given: list[dict[str, Any]], servers: ServersConfig, settings: CollectionSettings, call: Call
) -> Completions:
    record = call.record_output_dir is not None
    token = new_token()
    # A recorded call is named by its shard's opener token, which its manifest keeps: a process
    # that reattaches to it finds its reply list there (`producer/api/reattach.py`).
    invocation = token if record else uuid.uuid4().hex
    run_id = call.run_id or (new_run_id() if record else None)
    stamp = Stamp(run_id=run_id, shard=call.record_shard if record else None)
    prepared = prepare_rows(given, servers, settings, stamp)
    feed_plan(settings, prepared.sent, call.record_shard, record)  # refused before any is sent
    broker, state_url = _urls(call.broker_url, call.redis_url)
    if record:
        run = open_recorded_shard(
            rows=prepared.sent, output_dir=os.fspath(call.record_output_dir or ""),
            shard=call.record_shard, run_id=run_id or "", token=token, config=servers,
            settings=settings, overwrite=call.record_overwrite, redis_url=state_url,
        )  # fmt: skip
    else:
        run = RunRef(run_id=run_id or f"api-{invocation[:12]}", output_dir=INVOCATION_DIR + invocation,
                     token=token)  # fmt: skip
    sid = keys.shard_id(run.output_dir, run.shard)
    deadline = open_generation(
        client(state_url), sid, token, len(given), settings.dispatch_budget_s
    )
    transport = Invocation(
        invocation, prepared.sent, prepared.agents,
        Target(client_app(broker, state_url), state_url, run, servers, settings, deadline, record,
               call.record_omitted_rollouts),
        window=settings.max_resident_tasks, close_timeout_s=call.close_timeout_s,
        result_timeout_s=call.result_timeout_s,
    )  # fmt: skip
    # The caller gets the rows as sent: copies the call owns, never the caller's own objects.
    convert = _converter(prepared.sent, settings, call, run_id, run.run_id)
    return Completions(len(given), transport, convert, settings.max_resident_tasks is not None)


class Outcomes:
    """The async iterator `run_outcomes` returns; closed like `run_examples`' iterator."""

    def __init__(self, completions: Completions) -> None:
        self._completions = completions
        self._it = iter(completions)

    def __aiter__(self) -> AsyncIterator[Pair]:
        return self

    async def __anext__(self) -> Pair:
        try:
            future = next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None
        return await future

    async def aclose(self) -> None:
        """Cancel unfinished rollouts and wait until none runs (see `Completions.aclose`)."""
        await self._completions.aclose()

    async def aclose_and_drain(self) -> list[Any]:
        """Also return the settled, unconsumed outcomes once (see `Completions.aclose_and_drain`)."""
        return await self._completions.aclose_and_drain()


def run_outcomes(
    rows: Iterable[dict[str, Any]],
    config: ServersConfig | Mapping[str, Any] | str | os.PathLike[str],
    **options: Unpack[CallOptions],
) -> Outcomes:
    """Yield `(row, result | RolloutFailureRecord)` in completion order.

    Expected HTTP, JSON and result-shape failures of `/run` (and rows drained by the budget)
    become `RolloutFailureRecord`s; errors of the system itself (a worker that could not run
    the rollout, a fenced shard) and cancellation propagate. Nothing is persisted unless
    `record_output_dir` is given. The options are `run_examples`' `CallOptions`.
    """
    return Outcomes(_start("run_outcomes", rows, config, options, records=True, route=True))


def _start(
    name: str, rows: Iterable[dict[str, Any]],
    config: ServersConfig | Mapping[str, Any] | str | os.PathLike[str], options: CallOptions, *,
    records: bool, route: bool, record_unrouted_failures: bool = False,
) -> Completions:  # fmt: skip
    """A call's `Call` and settings from its options (refusing a name it does not take, as
    Python would), then its dispatch."""
    for key in options.keys() - CallOptions.__optional_keys__:
        raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
    given: dict[str, Any] = dict(options)
    call = Call(
        enrich=bool(given.get("enrich_results")) or given.get("record_output_dir") is not None,
        records=records, **{k: given[k] for k in _CALL_OPTIONS if k in given},
    )  # fmt: skip
    if record_unrouted_failures:
        call = dataclasses.replace(call, record_unrouted_failures=True)
    settings_options = {k: given[k] for k in _SETTING_OPTIONS if k in given}
    settings_options["route_failures_to_sidecar"] = route
    settings = _settings(given.get("settings"), **settings_options)
    return _dispatch(list(rows), _config(config), settings, call)


__all__ = ["CallOptions", "Completions", "Outcomes", "run_examples", "run_outcomes"]
