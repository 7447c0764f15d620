"""Configuration facts as written (`schemas.run_facts.ConfigFacts`), from either config format.

Read from the config document itself, before it is normalised (normalising drops what a run
does not call, such as an agent's `skip_verification` in NeMo Gym's format). Only names and
booleans are kept; a value that is interpolated (`${...}`), missing or of another type is
unknown (null), never replaced by a default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from producer.config.nemo_gym import is_nemo_gym_config
from schemas.config import ServersConfig
from schemas.run_facts import ConfigFacts, ServerFacts, ServerKind
from schemas.settings import CollectionSettings

MLFLOW_NAMES = ("mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name")
AGENTS: ServerKind = "responses_api_agents"
NORMALISED_KINDS: dict[str, ServerKind] = {
    "agents": AGENTS,
    "environments": "environment_servers",
    "resources_servers": "resources_servers",
}
NEMO_GYM_KINDS: tuple[ServerKind, ...] = (AGENTS, "resources_servers", "environment_servers")


def _name(value: Any) -> str | None:
    """A name as written: a concrete string, or a server reference's `name`."""
    if isinstance(value, Mapping):
        value = value.get("name")
    if isinstance(value, str) and value and "${" not in value:
        return value
    return None


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _server(kind: ServerKind, implementation: Any, cfg: Mapping[str, Any]) -> ServerFacts:
    agent = kind == AGENTS
    return ServerFacts(
        kind=kind,
        implementation=_name(implementation),
        resources_server=_name(cfg.get("resources_server")) if agent else None,
        skip_verification=_flag(cfg.get("skip_verification")) if agent else None,
    )


def _nemo_gym_servers(data: Mapping[str, Any]) -> Iterator[tuple[str, ServerFacts]]:
    for name, block in data.items():
        if not isinstance(block, Mapping):
            continue
        for kind in NEMO_GYM_KINDS:
            impls = block.get(kind)
            if isinstance(impls, Mapping) and impls:
                impl, cfg = next(iter(impls.items()))
                yield str(name), _server(kind, impl, cfg if isinstance(cfg, Mapping) else {})
                break


def _normalised_servers(data: Mapping[str, Any]) -> Iterator[tuple[str, ServerFacts]]:
    for section, kind in NORMALISED_KINDS.items():
        entries = data.get(section)
        for name, cfg in (entries if isinstance(entries, Mapping) else {}).items():
            if isinstance(cfg, Mapping):
                impl = cfg.get("type") if kind == AGENTS else cfg.get("implementation")
                yield str(name), _server(kind, impl, cfg)


def mlflow_names(data: Mapping[str, Any]) -> bool | None:
    """True when the three MLflow name fields are concrete strings, False when any is absent,
    null or empty, None when one is interpolated or not a string (no value is copied)."""
    values = [data.get(name) for name in MLFLOW_NAMES]
    if any(v is None or v == "" for v in values):
        return False
    if all(isinstance(v, str) and "${" not in v for v in values):
        return True
    return None


def config_facts(data: Mapping[str, Any]) -> ConfigFacts:
    """The facts of a config document in either format (the settings' part left unknown)."""
    nemo = is_nemo_gym_config(dict(data))
    servers = _nemo_gym_servers(data) if nemo else _normalised_servers(data)
    return ConfigFacts(servers=dict(servers), mlflow_names=mlflow_names(data))


def run_facts(config: ServersConfig, settings: CollectionSettings) -> ConfigFacts:
    """The facts a run records: its config's as written (`ServersConfig.written_facts`, else
    read from the model) and `route_failures_to_sidecar` when the run was given it."""
    facts = config.written_facts
    if facts is None:
        facts = config_facts(config.model_dump(mode="json", exclude_none=True))
    route = None
    if "route_failures_to_sidecar" in settings.model_fields_set:
        route = settings.route_failures_to_sidecar
    return facts.model_copy(update={"route_failures_to_sidecar": route})
