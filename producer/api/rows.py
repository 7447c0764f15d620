"""Checking the rows given to `run_examples` and building the bodies it sends, before any dispatch.

`run_examples` dispatches rows as given: routing knobs (agent_map, fan_out, num_repeats) belong
to `preprocess_examples`. What it still does, as NeMo Gym's does, is resolve rows that name only
a `task_source` to their agent and refuse, all at once, rows it cannot send: not an object, no
`responses_create_params`, no resolvable agent, an agent absent from the config (with a
did-you-mean), a pairing `allowed_agents` refuses. A materialized task row goes to its taskset's
environment server (`producer/planning/tasksets.py`), a flat row in `legacy` mode is aggregated
under `environment_server_name`. A recorded shard also needs each row's planned identity, unique
per shard, since that is what lands and what a resume reads; its rollout ids (and so the keys its
model calls are captured under) are prefixed with the shard's run id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from producer.planning.problems import ProblemLog
from producer.planning.reserved import check_sent_row
from producer.planning.routing import Route, Router, pairing_bypassed
from producer.planning.tasksets import (
    FLAT_ROW_IN_TASKSET_MODE,
    EnvironmentRouter,
    environment_routing,
    routing_problems,
    task_row_problems,
)
from schemas import fields as F
from schemas.config import ROUTING_KEYS, ServersConfig
from schemas.settings import CollectionSettings

SOURCE = "<rows>"


@dataclass
class Prepared:
    """The rows' bodies and agents, by position in the call."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    """The `/run` body of each row: a copy of the row (the caller's object is never kept, so
    what the caller does with it later changes nothing sent), with what was stamped."""
    agents: list[str] = field(default_factory=list)
    """The server each row's `/run` goes to: its agent, or a task row's environment server."""


@dataclass(frozen=True)
class Stamp:
    """What copies of the rows are stamped with."""

    run_id: str | None = None
    """`_ng_run_id`, when the call names a run."""
    shard: str | None = None
    """`_ng_shard` and the environment server: the rows are recorded in this shard."""


def _check_shape(row: dict[str, Any], n: int, log: ProblemLog) -> tuple[str | None, str | None]:
    """The row's agent_ref name and task_source, with a problem for each malformed one."""
    if F.is_task_row(row):
        for message, field_ in task_row_problems(row):
            log.add(message, n, field_)
    elif not isinstance(row.get(F.RESPONSES_CREATE_PARAMS), dict):
        log.add("responses_create_params must be a JSON object", n, F.RESPONSES_CREATE_PARAMS)
    ref, source = row.get(F.AGENT_REF), row.get(F.TASK_SOURCE)
    named = ref.get("name") if isinstance(ref, dict) else None
    if ref is not None and not (isinstance(named, str) and named):
        log.add("agent_ref must be an object with a non-empty string name", n, F.AGENT_REF)
        named = None
    if source is not None and not isinstance(source, str):
        log.add("task_source must be a string", n, F.TASK_SOURCE)
        source = None
    return named, source


def _check_identity(
    row: dict[str, Any], n: int, log: ProblemLog, seen: dict[tuple[int, int], int]
) -> None:
    """A recorded row's (task, rollout) key: non-negative integers, once per shard."""
    task, rollout = row.get(F.TASK_INDEX), row.get(F.ROLLOUT_INDEX)
    if not all(type(v) is int and v >= 0 for v in (task, rollout)):
        log.add(
            "a recorded row needs non-negative integer _ng_task_index and _ng_rollout_index; "
            "plan the rows with preprocess_examples first",
            n,
            F.TASK_INDEX,
        )
        return
    assert isinstance(task, int) and isinstance(rollout, int)
    first = seen.setdefault((task, rollout), n)
    if first != n:
        log.add(f"rollout {task}-{rollout} repeats the one of row {first}", n, F.ROLLOUT_INDEX)
    explicit = row.get(F.ROLLOUT_ID)
    if explicit is not None and not F.valid_rollout_id(explicit):
        log.add(f"invalid _ng_rollout_id {explicit!r}", n, F.ROLLOUT_ID)


def _recorded_id(row: dict[str, Any], run_id: str) -> str | None:
    """A recorded row's rollout id: its own (`_ng_rollout_id`, else `<task>-<rollout>`) prefixed
    with the shard's run id, so that two recorded shards sharing a capture directory never share
    a capture key; an id that carries the prefix already (a row read back from a shard) keeps it."""
    own = F.base_rollout_id(row)
    if own is None:
        return None
    return own if own.startswith(f"{run_id}-") else f"{run_id}-{own}"


def prepare_rows(
    rows: list[Any], config: ServersConfig, settings: CollectionSettings, stamp: Stamp
) -> Prepared:
    """Every row's body and agent; raises PlanningError listing every problem (rows from 1)."""
    log = ProblemLog(SOURCE)
    # Run-level routing knobs are preprocess_examples' business; only the pairing bypass and the
    # environment routing (where a task row, or a flat row in legacy mode, goes) apply.
    routing = CollectionSettings(
        allow_unsupported_pairing=settings.allow_unsupported_pairing,
        **{key: getattr(settings, key) for key in ROUTING_KEYS},
    )
    router = Router(config, routing, bypass_pairing=pairing_bypassed(settings))
    environments = environment_routing(config, routing)
    by_environment = EnvironmentRouter(router, environments)
    for problem in routing_problems(environments, config):
        log.add_problem(problem)
    seen: dict[tuple[int, int], int] = {}
    out = Prepared()
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            log.add(f"a row must be a dict, got {type(row).__name__}", n)
            continue
        try:
            encoded = orjson.dumps(row)
        except (orjson.JSONEncodeError, TypeError) as exc:
            log.add(f"the row is not JSON-serializable: {exc}", n)
            continue
        named, source = _check_shape(row, n, log)
        check_sent_row(row, n, log)
        env_stamp = row.get(F.ENVIRONMENT_SERVER)
        taskset = F.taskset_of(row)
        if F.is_task_row(row):
            route = by_environment.route_task(taskset, named, source) if taskset else Route(())
        elif environments.mode == "taskset":
            log.add(FLAT_ROW_IN_TASKSET_MODE, n, F.TASK_ID)
            continue
        elif environments.mode == "legacy":
            route = by_environment.route_legacy(named, source)
        else:
            route = router.route(named, source, env_stamp if isinstance(env_stamp, str) else None)
        for message, field_ in route.problems:
            log.add(message, n, field_)
        if stamp.shard is not None:
            _check_identity(row, n, log, seen)
            recorded_id = _recorded_id(row, stamp.run_id or "")
            if recorded_id is not None and not F.valid_rollout_id(recorded_id):
                log.add(f"the run id cannot prefix the rollout id: {recorded_id!r}", n, F.RUN_ID)
        if log.failed or not route.targets:
            continue
        target = route.targets[0]
        body = orjson.loads(encoded)
        restamp = not target.episode and named != target.agent
        # A task row always carries its environment server: the episode is sent there.
        placed = not target.episode or env_stamp == target.environment
        if restamp:
            body[F.AGENT_REF] = {"name": target.agent}
        if not placed:
            body[F.ENVIRONMENT_SERVER] = target.environment
        if stamp.run_id is not None:
            body[F.RUN_ID] = stamp.run_id
        if stamp.shard is not None:
            body[F.ENVIRONMENT_SERVER] = target.environment
            body[F.SHARD] = stamp.shard
            body[F.ROLLOUT_ID] = _recorded_id(row, stamp.run_id or "")
        out.sent.append(body)
        out.agents.append(target.agent)
    if log:
        raise log.error()
    return out
