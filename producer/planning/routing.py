"""Routing a row to its agents and environment server, and checking the pairing (docs/how-to/routing.md).

A row's route depends only on its `agent_ref.name`, its `task_source` and its environment
stamp, so it is computed once per distinct combination and cached: the per-row cost of routing
is one dict lookup however strict the checks are.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

from schemas.config import DatasetEntry, ServersConfig
from schemas.settings import CollectionSettings

PAIRING_ENV = "NEMO_GYM_ALLOW_UNSUPPORTED_PAIRING"
PAIRING_HINT = (
    "route these rows to an admitted agent, or pass +allow_unsupported_pairing=true "
    f"(or set {PAIRING_ENV}=1) to bypass the check"
)
_CACHE_LIMIT = 10_000

ProblemText = tuple[str, str | None]
"""A problem's message and the field it is about."""


@dataclass(frozen=True)
class Target:
    """One agent a row runs on, the environment server it is aggregated under, and how often."""

    agent: str
    """The agent that runs the row; for an episode, the environment server that does."""
    environment: str
    repeats: int
    episode: bool = False
    """A materialized task row: its environment server's `/run` runs it, and it names no agent."""


@dataclass(frozen=True)
class Route:
    """Where rows with one (agent_ref.name, task_source, environment stamp) go."""

    targets: tuple[Target, ...]
    problems: tuple[ProblemText, ...] = ()
    remapped: tuple[str, str] | None = None
    """(named agent, target) when agent_map overrode the row's own agent_ref."""

    @property
    def copies(self) -> int:
        return sum(t.repeats for t in self.targets)


def pairing_bypassed(settings: CollectionSettings) -> bool:
    flag = os.environ.get(PAIRING_ENV, "").strip().lower()
    return settings.allow_unsupported_pairing or flag not in ("", "0", "false", "no", "off")


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class Router:
    """Resolves rows to targets under one config and one set of settings."""

    config: ServersConfig
    settings: CollectionSettings
    bypass_pairing: bool = False
    used_repeat_keys: set[str] = field(default_factory=set)
    _cache: dict[tuple[str | None, str | None, str | None], Route] = field(default_factory=dict)

    def route(self, named: str | None, source: str | None, stamp: str | None) -> Route:
        key = (named, source, stamp)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            found = self._cache[key] = self._route(named, source, stamp)
        return found

    def _route(self, named: str | None, source: str | None, stamp: str | None) -> Route:
        problems: list[ProblemText] = []
        basis = named if named is not None else source
        fan = self.settings.fan_out.get(basis) if basis is not None else None
        if fan is not None:
            choices = [(agent, f"fan_out[{basis!r}]") for agent in fan]
        else:
            agent, origin = self._single(named, source, problems)
            choices = [] if agent is None else [(agent, origin)]
        targets = []
        for agent, origin in choices:
            target = self._target(agent, origin, basis, source, stamp, problems)
            if target is not None:
                targets.append(target)
        remapped = None
        if fan is None and named is not None and targets and targets[0].agent != named:
            remapped = (named, targets[0].agent)
        return Route(tuple(targets), tuple(dict.fromkeys(problems)), remapped)

    def _single(
        self, named: str | None, source: str | None, problems: list[ProblemText]
    ) -> tuple[str | None, str]:
        """The one agent a row without fan-out runs on, by docs/how-to/routing.md's precedence."""
        amap = self.settings.agent_map
        if named is not None and named in amap:
            return amap[named], f"agent_map[{named!r}]"
        if source is not None and source in amap:
            return amap[source], f"agent_map[{source!r}]"
        if "_default" in amap:
            return amap["_default"], "agent_map['_default']"
        if self.settings.agent_name is not None:
            return self.settings.agent_name, "agent_name"
        if named is not None:
            return named, "agent_ref"
        if source is not None:
            return self._from_source(source, problems), f"task_source {source!r}"
        problems.append(
            (
                "no agent for this row: it has no agent_ref and no task_source, and no "
                "--agent, +agent_name or +agent_map._default was given",
                "agent_ref",
            )
        )
        return None, ""

    def _from_source(self, source: str, problems: list[ProblemText]) -> str | None:
        """The agent a task_source resolves to: the agent itself, the one bound, or the one pinned."""
        config = self.config
        kind = config.kind_of(source)
        hint = f"; pass +agent_map.{source}=<agent> to choose"
        if kind is None:
            known = did_you_mean(source, config.instance_names())
            problems.append((f"task_source {source!r} is not in the config{known}", "task_source"))
            return None
        if kind == "agent":
            pins = sorted({d.agent for d in config.agents[source].datasets if d.agent} - {source})
            if pins:
                problems.append(
                    (
                        f"task_source {source!r} is an agent whose datasets pin other agents "
                        f"({', '.join(pins)}), but rows of an agent's dataset run on that "
                        f"agent{hint}",
                        "task_source",
                    )
                )
                return None
            return source
        datasets = self._datasets_of(source)
        pins = sorted({d.agent for d in datasets if d.agent})
        bound = self._bound_agents(source)
        if len(pins) > 1:
            problems.append(
                (
                    f"task_source {source!r}: its datasets pin conflicting agents "
                    f"({', '.join(pins)}), which task_source alone cannot tell apart{hint}",
                    "task_source",
                )
            )
            return None
        if pins:
            pin = pins[0]
            if pin in config.agents and (not bound or pin in bound):
                return pin
            why = (
                f"which is not in the config{did_you_mean(pin, list(config.agents))}"
                if pin not in config.agents
                else f"which is not bound to it (bound: {', '.join(bound)})"
            )
            problems.append(
                (f"task_source {source!r}: its datasets pin agent {pin!r}, {why}", "task_source")
            )
            return None
        if len(bound) == 1:
            return bound[0]
        what = "no agent is bound to it" if not bound else f"agents {', '.join(bound)} are bound"
        problems.append(
            (
                f"task_source {source!r} ({kind}) does not name one agent: {what}; pin one "
                f"with `agent:` in its dataset entry, or pass +agent_map.{source}=<agent>",
                "task_source",
            )
        )
        return None

    def _datasets_of(self, name: str) -> list[DatasetEntry]:
        config = self.config
        if name in config.agents:
            return config.agents[name].datasets
        if name in config.environments:
            return config.environments[name].datasets
        if name in config.resources_servers:
            return config.resources_servers[name].datasets
        return []

    def _bound_agents(self, name: str) -> list[str]:
        """Agents bound to an environment (it fronts them) or a resources server (they use it)."""
        config = self.config
        if name in config.environments:
            return sorted(a for a in config.agents if name in config.environments_of(a))
        out = []
        for agent, cfg in config.agents.items():
            envs = config.environments_of(agent)
            if cfg.resources_server == name or any(
                e in config.environments and config.environments[e].resources_server == name
                for e in envs
            ):
                out.append(agent)
        return sorted(out)

    def _target(
        self,
        agent: str,
        origin: str,
        basis: str | None,
        source: str | None,
        stamp: str | None,
        problems: list[ProblemText],
    ) -> Target | None:
        if agent not in self.config.agents:
            problems.append(self.unknown_agent(agent, origin))
            return None
        environment = self._environment(agent, source, stamp, problems)
        repeats = self.repeats_of(agent, basis, problems)
        if not self.bypass_pairing:
            problems.extend((p, None) for p in self.pairing(agent, source, environment))
        if environment is None or repeats is None:
            return None
        return Target(agent, environment, repeats)

    def unknown_agent(self, agent: str, origin: str) -> ProblemText:
        """The problem of a row sent to `agent` (named by `origin`), which is no agent of the config."""
        config = self.config
        other = config.kind_of(agent)
        article = "an" if other and other[0] in "aeiou" else "a"
        why = (
            f"; {agent!r} is {article} {other}, not an agent"
            if other
            else did_you_mean(agent, list(config.agents))
        )
        row_field = "agent_ref" if origin == "agent_ref" else None
        return f"agent {agent!r} (from {origin}) is not in the config{why}", row_field

    def _environment(
        self, agent: str, source: str | None, stamp: str | None, problems: list[ProblemText]
    ) -> str | None:
        """The environment server the agent's rows are aggregated under (docs/how-to/routing.md)."""
        config = self.config
        own = config.agents[agent].environment
        if own is not None and own not in config.environments:
            known = did_you_mean(own, list(config.environments))
            problems.append(
                (
                    f"Agent {agent!r} has no environment server, so collection cannot reach it: "
                    f"it names environment {own!r}, which is not in the config{known}",
                    None,
                )
            )
            return None
        servers = config.environments_of(agent)
        if not servers:
            return agent  # aggregated at the agent's own URL
        if len(servers) == 1:
            return servers[0]
        for hint in (source, stamp):
            if hint in servers:
                return hint
        problems.append(
            (
                f"Agent {agent!r} is fronted by several environment servers: {servers}. Rows "
                "that route by agent cannot choose between them. Set "
                "environment_routing_mode=legacy with environment_server_name, or route these "
                "rows by taskset (or give the agent one `environment`, or set the rows' "
                "task_source to one of them)",
                None,
            )
        )
        return None

    def repeats_of(
        self, agent: str | None, basis: str | None, problems: list[ProblemText]
    ) -> int | None:
        """`num_repeats` of a row sent to `agent` (None: to an environment server) whose routing
        basis is `basis`: by the agent, then the basis, then `_default`."""
        n = self.settings.num_repeats
        if isinstance(n, int):
            return n
        for key in (agent, basis, "_default"):
            if key is not None and key in n:
                self.used_repeat_keys.add(key)
                return n[key]
        keys = " / ".join(k for k in dict.fromkeys((agent, basis)) if k is not None)
        problems.append(
            (
                f"num_repeats has no entry for {keys} and no '_default'; listed keys: "
                f"{', '.join(sorted(n))}",
                "num_repeats",
            )
        )
        return None

    def pairing(
        self, agent: str, source: str | None, environment: str | None, own_datasets: bool = True
    ) -> list[str]:
        """Refusals by the allowed_agents of everything the row meets
        (docs/how-to/routing.md#pairings); `own_datasets`: also those of the dataset entries the
        agent declares (its flat rows')."""
        config = self.config
        cfg = config.agents[agent]
        checks: dict[str, list[str] | None] = {}
        if source is not None and source in config.environments:
            checks[f"environment {source!r} (the row's task_source)"] = config.environments[
                source
            ].allowed_agents
        if source is not None and source in config.resources_servers:
            checks[f"resources server {source!r} (the row's task_source)"] = (
                config.resources_servers[source].allowed_agents
            )
        bound_rs = [cfg.resources_server]
        if environment in config.environments:
            env = config.environments[environment]
            if environment != source:
                checks[f"environment {environment!r}, which fronts agent {agent!r}"] = (
                    env.allowed_agents
                )
            bound_rs.append(env.resources_server)
        for rs in dict.fromkeys(bound_rs):
            if rs is not None and rs != source and rs in config.resources_servers:
                checks[f"resources server {rs!r}, which agent {agent!r} binds"] = (
                    config.resources_servers[rs].allowed_agents
                )
        for d in cfg.datasets if own_datasets else ():
            checks[f"dataset {d.name or '?'!r} declared by agent {agent!r}"] = d.allowed_agents
        if source is not None and source != agent:
            for d in self._datasets_of(source):
                if d.agent in (None, agent):
                    checks[f"dataset {d.name or '?'!r} declared by {source!r}"] = d.allowed_agents
        refusals = []
        for where, allowed in checks.items():
            if allowed is None or (cfg.type is not None and cfg.type in allowed):
                continue
            kind = f"type {cfg.type!r}" if cfg.type is not None else "no type"
            refusals.append(
                f"agent {agent!r} ({kind}) is not admitted by {where}, which accepts only: "
                f"{', '.join(allowed) or 'nothing'}; {PAIRING_HINT}"
            )
        return refusals


DEFERRED = ""
"""A target's agent or environment left for `run_examples` to resolve (no config to planning)."""


@dataclass
class DeferredRouter(Router):
    """Routes rows without a config (`preprocess_examples` without one): a row keeps its own
    agent (or the one `agent_map`/`agent_name`/`fan_out` names) unchecked, and a row that names
    only a `task_source` is left to `run_examples`, which resolves it against its config (a
    NeMo Gym head server's, say). Repeats follow the row's agent, else its basis, else
    `_default`; no environment server is stamped."""

    def _route(self, named: str | None, source: str | None, stamp: str | None) -> Route:
        problems: list[ProblemText] = []
        basis = named if named is not None else source
        fan = self.settings.fan_out.get(basis) if basis is not None else None
        if fan is not None:
            agents = list(fan)
        elif named is None and source is not None and not self._named_by_settings(named, source):
            agents = [DEFERRED]
        else:
            agent, _ = self._single(named, source, problems)
            agents = [] if agent is None else [agent]
        targets = []
        for agent in agents:
            repeats = self.repeats_of(agent, basis, problems)
            if repeats is not None:
                targets.append(Target(agent, DEFERRED, repeats))
        return Route(tuple(targets), tuple(dict.fromkeys(problems)))

    def _named_by_settings(self, named: str | None, source: str) -> bool:
        amap = self.settings.agent_map
        return source in amap or "_default" in amap or self.settings.agent_name is not None
