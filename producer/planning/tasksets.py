"""Rows routed by environment server: materialized task rows, and flat rows in `legacy` mode.

NeMo Gym's `environment_routing_mode` decides how a flat row reaches an environment server:
`agent` (the default) by its agent (`producer/planning/routing.py`), `legacy` every flat row to
`environment_server_name`, `taskset` none at all (a run of materialized task rows only). A
materialized task row (`{"task_id": {"taskset", "task_id"}, "task_input": {...}}`) always goes
to `environment_server_routes[taskset]`, whose `POST /run` runs it as an episode. The three
keys come from the servers config (either format) and from the run's settings (`+key=value`),
the settings winning; their problems are the config's, located at the key that set them.

Rows routed by environment server take no `agent_map` or `fan_out`, as in NeMo Gym: their repeats
are looked up by taskset (else task_source, else the server). A legacy row runs on its own agent,
else the server's attributed agent, which must be one of the agents the server fronts; a task row
runs on the server itself and carries no agent. The pairing checks apply to the agent that runs
it: the server's attributed agent for a task row, against the `allowed_agents` of the server, its
resources server, the row's task_source and every dataset entry declaring the row's taskset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producer.planning.routing import (
    PAIRING_HINT,
    ProblemText,
    Route,
    Router,
    Target,
    did_you_mean,
)
from schemas import fields as F
from schemas.config import ROUTING_KEYS, RoutingMode, ServersConfig
from schemas.errors import Problem
from schemas.settings import CollectionSettings

LEGACY_NEEDS_NAME = "environment_server_name is required when environment_routing_mode=legacy"
TASKSET_NEEDS_ROUTES = (
    "environment_server_routes are required when environment_routing_mode=taskset"
)
FLAT_ROW_IN_TASKSET_MODE = (
    "taskset routing requires rows containing task_id.taskset and task_input; "
    "use environment_routing_mode=agent to mix materialized and flat rows in one batch"
)
ADD_SEED_REFUSED = "num_repeats_add_seed is not supported for materialized task rows"


@dataclass(frozen=True)
class EnvironmentRouting:
    """The effective routing keys of a run, and where each came from (for messages)."""

    mode: RoutingMode = "agent"
    server_name: str | None = None
    routes: dict[str, str] = field(default_factory=dict)
    origins: dict[str, tuple[str | None, int | None]] = field(default_factory=dict)
    """Key -> (file, line) of the config that set it; absent when the settings did."""

    def problem(self, message: str, key: str) -> Problem:
        """`message` located where `key` was set: the config file and line, else the setting."""
        file, line = self.origins.get(key, (None, None))
        return Problem(message, file=file, line=line, field=key)


def environment_routing(config: ServersConfig, settings: CollectionSettings) -> EnvironmentRouting:
    """The routing keys of `settings`, else of `config`."""
    values: dict[str, Any] = {}
    origins: dict[str, tuple[str | None, int | None]] = {}
    for key in ROUTING_KEYS:
        value = getattr(settings, key)
        if value is None:
            value = getattr(config, key)
            if value is not None:
                origins[key] = config.where(key)
        values[key] = value
    return EnvironmentRouting(
        mode=values["environment_routing_mode"] or "agent",
        server_name=values["environment_server_name"],
        routes=dict(values["environment_server_routes"] or {}),
        origins=origins,
    )


def routing_problems(routing: EnvironmentRouting, config: ServersConfig) -> list[Problem]:
    """What is wrong with the routing keys themselves (NeMo Gym's config validation)."""
    out = []
    mode_key = "environment_routing_mode"
    if routing.mode == "legacy" and routing.server_name is None:
        out.append(routing.problem(LEGACY_NEEDS_NAME, mode_key))
    if routing.mode == "taskset" and not routing.routes:
        out.append(routing.problem(TASKSET_NEEDS_ROUTES, mode_key))
    known = list(config.environments)
    if routing.server_name is not None and routing.server_name not in config.environments:
        out.append(
            routing.problem(
                f"environment server {routing.server_name!r} is not present in the running "
                f"config{did_you_mean(routing.server_name, known)}",
                "environment_server_name",
            )
        )
    for taskset, server in sorted(routing.routes.items()):
        if server not in config.environments:
            out.append(
                routing.problem(
                    f"the route of taskset {taskset!r} names environment server {server!r}, "
                    f"which is not present in the running config{did_you_mean(server, known)}",
                    "environment_server_routes",
                )
            )
    return out


def task_row_problems(row: dict[str, Any]) -> list[ProblemText]:
    """What makes a materialized task row malformed: NeMo Gym's `TaskId` and a task input object."""
    out: list[ProblemText] = []
    task_id = row[F.TASK_ID]
    taskset, ident = task_id.get("taskset"), task_id.get("task_id")
    if not (isinstance(taskset, str) and taskset):
        out.append(("task_id.taskset must be a non-empty string", "task_id.taskset"))
    if not (isinstance(ident, str) and ident):
        out.append(("task_id.task_id must be a non-empty string", "task_id.task_id"))
    extra = sorted(set(task_id) - {"taskset", "task_id"})
    if extra:
        out.append((f"task_id has fields other than taskset and task_id: {extra}", "task_id"))
    if not isinstance(row[F.TASK_INPUT], dict):
        out.append(("task_input must be a JSON object", "task_input"))
    return out


@dataclass
class EnvironmentRouter:
    """Routes rows that go by environment server, once per distinct key (as `Router` does)."""

    router: Router
    routing: EnvironmentRouting
    _cache: dict[tuple[str, str | None, str | None, str | None], Route] = field(
        default_factory=dict
    )

    @property
    def config(self) -> ServersConfig:
        return self.router.config

    def route_task(self, taskset: str, named: str | None, source: str | None) -> Route:
        """A materialized task row of `taskset`: its route's environment server runs it."""
        key = ("task", taskset, named, source)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._task(taskset, named, source)
        return found

    def route_legacy(self, named: str | None, source: str | None) -> Route:
        """A flat row in `legacy` mode: run on its agent, aggregated under `environment_server_name`."""
        key = ("legacy", "", named, source)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._legacy(named, source)
        return found

    def _task(self, taskset: str, named: str | None, source: str | None) -> Route:
        problems: list[ProblemText] = []
        server = self.routing.routes.get(taskset)
        if server is None:
            problems.append(
                (
                    f"No environment server route is configured for taskset {taskset!r}",
                    "task_id.taskset",
                )
            )
            return Route((), tuple(problems))
        if server not in self.config.environments:
            return Route(())  # the route's own problem is the config's (`routing_problems`)
        agent = self.config.attributed_agent(server)
        self._server_checks(server, named, source, problems)
        repeats = self.router.repeats_of(None, taskset or source or server, problems)
        if agent is not None and not self.router.bypass_pairing:
            problems.extend((p, None) for p in self._pairing(agent, server, source, taskset))
        if repeats is None or problems:
            return Route((), tuple(dict.fromkeys(problems)))
        return Route((Target(server, server, repeats, episode=True),))

    def _legacy(self, named: str | None, source: str | None) -> Route:
        problems: list[ProblemText] = []
        server = self.routing.server_name
        if server is None or server not in self.config.environments:
            return Route(())  # the config's problem (`routing_problems`)
        agent = named if named is not None else self.config.attributed_agent(server)
        if agent is None:
            fronted = self.config.fronted_by(server)
            what = f"fronts {', '.join(fronted)}" if fronted else "fronts no agent"
            problems.append(
                (
                    f"no agent for this row: it names none, and environment server {server!r} "
                    f"(environment_server_name) {what} without an agent_server",
                    "agent_ref",
                )
            )
            return Route((), tuple(problems))
        if agent not in self.config.agents:
            problems.append(self.router.unknown_agent(agent, "agent_ref" if named else server))
            return Route((), tuple(problems))
        self._server_checks(server, agent, source, problems)
        repeats = self.router.repeats_of(None, source or server, problems)
        if not self.router.bypass_pairing:
            problems.extend((p, None) for p in self.router.pairing(agent, source, server))
        if repeats is None or problems:
            return Route((), tuple(dict.fromkeys(problems)))
        return Route((Target(agent, server, repeats),))

    def _server_checks(
        self, server: str, agent: str | None, source: str | None, problems: list[ProblemText]
    ) -> None:
        """NeMo Gym's checks of a row sent to an environment server: its agent is one the server
        fronts, its task_source the resources server the server binds."""
        config = self.config
        fronted = config.fronted_by(server)
        if agent is not None and fronted and agent not in fronted:
            names = ", ".join(repr(a) for a in fronted)
            problems.append(
                (
                    f"Row agent_ref {agent!r} is not an agent of environment server {server!r}: "
                    f"{names}",
                    "agent_ref",
                )
            )
        bound = config.environments[server].resources_server
        if source is not None and bound is not None and source != bound:
            problems.append(
                (
                    f"Row task_source {source!r} does not match environment server {server!r} "
                    f"resources server {bound!r}",
                    "task_source",
                )
            )

    def _pairing(self, agent: str, server: str, source: str | None, taskset: str) -> list[str]:
        """The refusals of the agent that runs a task row: those of any row sent to the server,
        and the `allowed_agents` of every dataset entry declaring the taskset."""
        config = self.config
        refusals = (
            self.router.pairing(agent, source, server, own_datasets=False)
            if agent in config.agents
            else []
        )
        kind = config.agents[agent].type if agent in config.agents else None
        for owner, entry in self._taskset_entries(taskset):
            allowed = entry.allowed_agents
            if allowed is None or (kind is not None and kind in allowed):
                continue
            shown = f"type {kind!r}" if kind is not None else "no type"
            refusals.append(
                f"agent {agent!r} ({shown}), which environment server {server!r} runs taskset "
                f"{taskset!r} with, is not admitted by dataset {entry.name or '?'!r} declared by "
                f"{owner!r}, which accepts only: {', '.join(allowed) or 'nothing'}; {PAIRING_HINT}"
            )
        return refusals

    def _taskset_entries(self, taskset: str) -> list[tuple[str, Any]]:
        config = self.config
        owners: list[tuple[str, Any]] = [
            *config.agents.items(),
            *config.environments.items(),
            *config.resources_servers.items(),
        ]
        return [(name, d) for name, cfg in owners for d in cfg.datasets if d.taskset == taskset]
