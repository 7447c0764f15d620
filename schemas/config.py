"""The servers a run talks to, in their normalised form (docs/reference/servers-config.md)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, PrivateAttr, model_validator

from schemas import fields as F
from schemas.base import StrictModel
from schemas.run_facts import ConfigFacts

# Key, header and query-parameter names whose values are secrets, matched case-insensitively
# anywhere in the name: `api_key`, `X-Api-Key`, `openai_key`, `hf_access_key`, `private_key`,
# `aws_access_key_id`, `aws_secret_access_key`, `Authorization`, `Proxy-Authorization`, `token`,
# `password`, `passwd`, `credentials`, `client_secret`, `cookie`, `session`, `signature`, ...
_SECRET_KEY = re.compile(
    r"(?:^|[^a-z])key(?:$|[^a-z])|_key|key_|api.?key|token(?![a-z])|secret|passw(?:or)?d|pwd|auth"
    r"|credential|bearer|cookie|session|signature|private",
    re.IGNORECASE,
)
# `scheme://user:password@host`: the password part of a URL's userinfo.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)[^/@\s]*(?P<at>@)")
# `name=value` in a URL's query string or fragment.
_QUERY_PARAM = re.compile(r"(?P<head>[?&#;](?P<name>[^=&#\s]+)=)(?P<value>[^&#\s]*)")
# A credential written as a header value: `Bearer ...`, `Basic ...`, `Token ...`.
_AUTH_SCHEME = re.compile(r"^\s*(?:bearer|basic|token|digest)\s+\S", re.IGNORECASE)
REDACTED = "***"

RoutingMode = Literal["agent", "legacy", "taskset"]
"""NeMo Gym's `environment_routing_mode`: how flat rows reach an environment server."""
ROUTING_KEYS = ("environment_routing_mode", "environment_server_name", "environment_server_routes")


class DatasetEntry(BaseModel):
    """A dataset an environment or resources server declares; rows naming it as `task_source` come from it."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    """The dataset's name, for messages."""
    agent: str | None = None
    """The agent the dataset pins its rows to, if any."""
    allowed_agents: list[str] | None = None
    """Harness types the dataset admits; None admits any."""
    taskset: str | None = None
    """The taskset of the dataset's materialized task rows (rows whose `task_id.taskset` it is)."""


class AgentConfig(BaseModel):
    """A harness serving `POST /run`."""

    model_config = ConfigDict(extra="allow")

    url: str
    """Base URL; `/run` is appended."""
    type: str | None = None
    """Harness type, matched against `allowed_agents`."""
    environment: str | None = None
    """The environment server that fronts this agent and aggregates its rows."""
    resources_server: str | None = None
    """The resources server this agent binds, if any."""
    max_concurrency: int | None = Field(default=None, ge=1)
    """Cluster-wide cap on concurrent `/run` calls to this agent; its adaptive window starts
    there (none declared: it slow-starts)."""
    datasets: list[DatasetEntry] = Field(default_factory=list)
    """Datasets this agent declares."""


class EnvironmentConfig(BaseModel):
    """An environment server: verification and `POST /aggregate_metrics`."""

    model_config = ConfigDict(extra="allow")

    url: str
    """Base URL; `/aggregate_metrics` is appended."""
    resources_server: str | None = None
    """The resources server this environment binds, if any."""
    allowed_agents: list[str] | None = None
    """Harness types this environment admits; None admits any."""
    datasets: list[DatasetEntry] = Field(default_factory=list)
    """Datasets whose rows say `task_source: <this environment>`."""
    agents: list[str] = Field(default_factory=list)
    """Agents this environment fronts besides those naming it as their `environment`."""
    agent_server: str | None = None
    """The agent its results are attributed to (NeMo Gym's `agent_server`); else the only agent
    it fronts."""


class ResourcesServerConfig(BaseModel):
    """A resources server (verifier and tools)."""

    model_config = ConfigDict(extra="allow")

    url: str | None = None
    """Base URL, if the run needs to reach it."""
    allowed_agents: list[str] | None = None
    """Harness types the verifier accepts; None accepts any."""
    datasets: list[DatasetEntry] = Field(default_factory=list)
    """Datasets this resources server declares."""


class ServersConfig(StrictModel):
    """Every server of a run, by instance name."""

    agents: dict[str, AgentConfig] = Field(default_factory=dict)
    """Agent instances by name."""
    environments: dict[str, EnvironmentConfig] = Field(default_factory=dict)
    """Environment server instances by name."""
    resources_servers: dict[str, ResourcesServerConfig] = Field(default_factory=dict)
    """Resources server instances by name."""
    environment_routing_mode: RoutingMode | None = None
    """How flat rows reach an environment server (`agent` when unset); a run's
    `+environment_routing_mode` overrides it."""
    environment_server_name: str | None = None
    """The environment server of every flat row in `legacy` mode."""
    environment_server_routes: dict[str, str] | None = None
    """The environment server of each taskset's materialized task rows."""
    _source: str | None = PrivateAttr(default=None)
    _lines: dict[str, int] = PrivateAttr(default_factory=dict)
    _written: ConfigFacts | None = PrivateAttr(default=None)

    def located(self, source: str | None, lines: dict[str, int]) -> ServersConfig:
        """This config, remembering the file it was read from and the line of each top-level key."""
        self._source, self._lines = source, dict(lines)
        return self

    def where(self, key: str) -> tuple[str | None, int | None]:
        """The file this config was read from and the line of its top-level `key`, when known."""
        return self._source, self._lines.get(key)

    @property
    def written_facts(self) -> ConfigFacts | None:
        """What the config document stated as written (`producer/config/facts.py`), when this
        config was read from one; None when it was built in code."""
        return self._written

    def with_written_facts(self, facts: ConfigFacts) -> ServersConfig:
        """This config, carrying the facts of the document it was read from."""
        self._written = facts
        return self

    @model_validator(mode="after")
    def _unique_instance_names(self) -> ServersConfig:
        # Rows name instances (agent_ref, task_source) without saying which kind they are.
        clashes = sorted(
            (set(self.agents) & set(self.environments))
            | (set(self.agents) & set(self.resources_servers))
            | (set(self.environments) & set(self.resources_servers))
        )
        if clashes:
            raise ValueError(
                f"instance names must be unique across agents, environments and "
                f"resources_servers; used more than once: {', '.join(clashes)}"
            )
        return self

    def kind_of(self, name: str) -> str | None:
        """`agent`, `environment`, `resources server`, or None for a name the config lacks."""
        if name in self.agents:
            return "agent"
        if name in self.environments:
            return "environment"
        if name in self.resources_servers:
            return "resources server"
        return None

    def instance_names(self) -> list[str]:
        return [*self.agents, *self.environments, *self.resources_servers]

    def environments_of(self, agent: str) -> list[str]:
        """The environment servers that front `agent`.

        Its own `environment` when set; else every environment naming it as `agent_server`, listing
        it in `agents` or pinning it in a dataset entry.
        """
        cfg = self.agents[agent]
        if cfg.environment is not None:
            return [cfg.environment]
        return sorted(
            name
            for name, env in self.environments.items()
            if agent in env.agents
            or env.agent_server == agent
            or any(d.agent == agent for d in env.datasets)
        )

    def fronted_by(self, environment: str) -> list[str]:
        """The agents `environment` fronts, sorted."""
        return sorted(a for a in self.agents if environment in self.environments_of(a))

    def attributed_agent(self, environment: str) -> str | None:
        """The agent `environment`'s results are attributed to: its `agent_server`, else the only
        agent it fronts; None when it fronts none or several without an `agent_server`."""
        env = self.environments.get(environment)
        if env is None:
            return None
        if env.agent_server is not None:
            return env.agent_server
        fronted = self.fronted_by(environment)
        return fronted[0] if len(fronted) == 1 else None

    def server_of(self, row: dict[str, Any]) -> str | None:
        """The environment server `row` is aggregated under: its `_ng_environment_server` stamp,
        else the one server that fronts its agent (the agent itself when none does); None when
        that is not one server."""
        stamp = row.get(F.ENVIRONMENT_SERVER)
        if isinstance(stamp, str):
            return stamp
        agent = F.agent_name(row)
        if agent is None or agent not in self.agents:
            return None
        servers = self.environments_of(agent)
        if not servers:
            return agent  # an agent without an environment server is aggregated at its own URL
        return servers[0] if len(servers) == 1 else None

    def aggregation_url(self, server: str) -> str:
        """Where `/aggregate_metrics` for rows stamped with `server` goes.

        An agent with no environment server is aggregated at its own URL (docs/reference/servers-config.md).
        """
        if server in self.environments:
            return self.environments[server].url
        return self.agents[server].url

    def redacted(self) -> dict[str, JsonValue]:
        """The config as JSON, with every secret-looking value replaced."""
        redacted: dict[str, JsonValue] = redact(self.model_dump(mode="json", exclude_none=True))
        return redacted


def is_secret_name(name: str) -> bool:
    """Whether a key, header or query parameter of this name holds a secret."""
    return _SECRET_KEY.search(name) is not None


def redact(value: Any) -> Any:
    """A copy of `value` with secrets replaced by `***`: the values of secret-looking keys, header
    values that carry a credential (`Bearer ...`), URL passwords and secret query parameters."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_name(k) else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        if _AUTH_SCHEME.match(value):
            return REDACTED
        if "@" in value or "=" in value:
            return redact_url(value)
    return value


def masked_paths(value: Any, path: str = "") -> list[str]:
    """The dotted paths in `value` (a redacted config) whose values hold a masked secret."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in masked_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in masked_paths(v, f"{path}[{i}]")]
    return [path] if isinstance(value, str) and REDACTED in value else []


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo (`scheme://user:password@host`) and the values of
    secret query parameters (`?api_key=...`) replaced by `***`."""
    url = _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}{m['at']}", url)
    return _QUERY_PARAM.sub(
        lambda m: f"{m['head']}{REDACTED}" if is_secret_name(m["name"]) else m[0], url
    )
