"""Facts a quality summary records about how a run was configured and what its verdict was read from.

Configuration facts are names and flags as written, never defaults and never values beyond them
(no URL, key or token is copied): they let a reader of the summary tell a run that skipped
verification, or routed its failures aside, from one that did not. Gate facts bind the
verdict a gate judges to the SHA-256 of the saved rollout inputs it was read from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import FrozenModel

ServerKind = Literal["responses_api_agents", "resources_servers", "environment_servers"]


class ServerFacts(FrozenModel):
    """One server entry of the config, by its instance name."""

    kind: ServerKind
    """Which kind of server the entry is."""
    implementation: str | None = None
    """Its implementation key (NeMo Gym's `<kind>: {<impl>: ...}`, our agents' `type`), as written."""
    resources_server: str | None = None
    """For an agent: the resources server it names, as written."""
    skip_verification: bool | None = None
    """For an agent: its `skip_verification` when written as a boolean; else null (absent,
    interpolated or not a boolean), never a default."""


class ConfigFacts(FrozenModel):
    """What the run's config and settings state, as written."""

    route_failures_to_sidecar: bool | None = None
    """The setting when the run was given it; null when it ran with the default."""
    servers: dict[str, ServerFacts] = Field(default_factory=dict)
    """Every agent, resources server and environment server of the config (model servers are
    not servers a run calls)."""
    mlflow_names: bool | None = None
    """Whether the config's three MLflow name fields (`mlflow_tracking_uri`,
    `mlflow_experiment_name`, `mlflow_run_name`) are concrete: true when all three are non-empty
    strings, false when any is absent, null or empty, null when one is interpolated or not a
    string. It says nothing of whether anything was exported; no value is copied."""


class InputDigest(FrozenModel):
    """One saved rollout input a verdict was read from."""

    source: str
    """The rollouts file's label (`run.sources`)."""
    kind: Literal["results", "failures", "materialized"]
    """The rollouts file itself, its failures sidecar, or its materialized inputs."""
    bytes: int
    """Its size when read."""
    sha256: str
    """The SHA-256 of its bytes."""
