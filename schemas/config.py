"""The servers a run talks to, in the normalised form of SPEC §2."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_SECRET_KEY = re.compile(r"api_key|apikey|token|secret|password", re.IGNORECASE)
REDACTED = "***"


class DatasetEntry(BaseModel):
    """A dataset an environment or resources server declares; rows naming it as `task_source` come from it."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    """The dataset's name, for messages."""
    agent: str | None = None
    """The agent the dataset pins its rows to, if any."""
    allowed_agents: list[str] | None = None
    """Harness types the dataset admits; None admits any."""


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
    """Cluster-wide cap on concurrent `/run` calls to this agent."""
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


class ResourcesServerConfig(BaseModel):
    """A resources server (verifier and tools)."""

    model_config = ConfigDict(extra="allow")

    url: str | None = None
    """Base URL, if the run needs to reach it."""
    allowed_agents: list[str] | None = None
    """Harness types the verifier accepts; None accepts any."""
    datasets: list[DatasetEntry] = Field(default_factory=list)
    """Datasets this resources server declares."""


class ServersConfig(BaseModel):
    """Every server of a run, by instance name."""

    model_config = ConfigDict(extra="forbid")

    agents: dict[str, AgentConfig] = Field(default_factory=dict)
    """Agent instances by name."""
    environments: dict[str, EnvironmentConfig] = Field(default_factory=dict)
    """Environment server instances by name."""
    resources_servers: dict[str, ResourcesServerConfig] = Field(default_factory=dict)
    """Resources server instances by name."""

    def environments_of(self, agent: str) -> list[str]:
        """The environment servers that front `agent`: its own `environment`, else those naming it in datasets."""
        cfg = self.agents[agent]
        if cfg.environment is not None:
            return [cfg.environment]
        return sorted(
            name
            for name, env in self.environments.items()
            if any(d.agent == agent for d in env.datasets)
        )

    def aggregation_url(self, server: str) -> str:
        """Where `/aggregate_metrics` for rows stamped with `server` goes.

        An agent with no environment server is aggregated at its own URL (SPEC §2).
        """
        if server in self.environments:
            return self.environments[server].url
        return self.agents[server].url

    def redacted(self) -> dict[str, Any]:
        """The config as JSON, with every secret-looking value replaced."""
        redacted: dict[str, Any] = redact(self.model_dump(mode="json", exclude_none=True))
        return redacted


def redact(value: Any) -> Any:
    """A copy of `value` with the values of secret-looking keys replaced by `***`."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
