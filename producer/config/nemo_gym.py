"""NeMo Gym's global config, normalised to the servers config of docs/reference/servers-config.md.

NeMo Gym names every server at the top level: `name: {server_type: {impl_name: {host, port,
...}}}`. Agents (`responses_api_agents`) become `agents` with their implementation name as
`type` and their `resources_server: {type, name}` reference as `resources_server`; environment
servers (`environment_servers`) become `environments`, fronting the agents their
`agent_server` (or any `type: responses_api_agents` reference) names; `resources_servers` stay
as they are. Model servers and global settings (`head_server`, `policy_api_key`, ...) are not
servers a run calls and are left out, as is every field a server block has beyond its address,
binding and datasets, so the keys and tokens it holds never reach the run's manifest. The
run-level routing keys (`environment_routing_mode`, `environment_server_name`,
`environment_server_routes`) are kept as they are.
"""

from __future__ import annotations

from typing import Any

from schemas.config import ROUTING_KEYS
from schemas.errors import Problem

AGENTS = "responses_api_agents"
ENVIRONMENTS = "environment_servers"
RESOURCES = "resources_servers"
MODELS = "responses_api_models"
SERVER_TYPES = (AGENTS, ENVIRONMENTS, RESOURCES, MODELS)
NORMALISED_SECTIONS = ("agents", "environments", "resources_servers")


def is_nemo_gym_config(data: dict[str, Any]) -> bool:
    """True when `data` is NeMo Gym's format: some top-level value is a server block."""
    return any(isinstance(v, dict) and _server_type(v) is not None for v in data.values())


def _server_type(block: dict[str, Any]) -> str | None:
    found = [t for t in SERVER_TYPES if t in block]
    return found[0] if found else None


def _ref_name(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return str(value["name"])
    return value if isinstance(value, str) else None


def _url(cfg: dict[str, Any]) -> str | None:
    if isinstance(cfg.get("url"), str):
        return str(cfg["url"])
    host, port = cfg.get("host"), cfg.get("port")
    if host in (None, "") or port in (None, "") or "${" in f"{host}{port}":
        return None
    return f"http://{host}:{port}"


def _datasets(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for d in cfg.get("datasets") or []:
        if isinstance(d, dict):
            entry = {k: d[k] for k in ("name", "agent", "allowed_agents", "taskset") if k in d}
            entry["agent"] = _ref_name(entry.get("agent"))
            out.append({k: v for k, v in entry.items() if v is not None})
    return out


def normalise(data: dict[str, Any], source: str) -> tuple[dict[str, Any], list[Problem]]:
    """The normalised form of a NeMo Gym global config, and what stops it from being one."""
    agents: dict[str, Any] = {}
    environments: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, block in data.items():
        if not isinstance(block, dict):
            continue
        kind = _server_type(block)
        if kind is None or kind == MODELS:
            continue
        impls = block[kind]
        if not isinstance(impls, dict) or not impls:
            problems.append(
                Problem(
                    f"{kind} must map an implementation name to its config",
                    file=source,
                    field=f"{name}.{kind}",
                )
            )
            continue
        impl, cfg = next(iter(impls.items()))
        if not isinstance(cfg, dict):
            problems.append(
                Problem(
                    "the server's config must be a mapping",
                    file=source,
                    field=f"{name}.{kind}.{impl}",
                )
            )
            continue
        url = _url(cfg)
        if url is None and kind != RESOURCES:
            problems.append(
                Problem(
                    "no host and port (or url): a config file names reachable servers only "
                    "once they run; read the running config with --head-server instead",
                    file=source,
                    field=f"{name}.{kind}.{impl}",
                )
            )
            continue
        # Only what routing and calls need: the rest of a block says how to start the server.
        entry: dict[str, Any] = {"url": url, "datasets": _datasets(cfg)}
        if kind == AGENTS:
            entry["type"] = impl
            entry["resources_server"] = _ref_name(cfg.get("resources_server"))
            agents[name] = entry
        elif kind == ENVIRONMENTS:
            entry["implementation"] = impl
            entry["resources_server"] = _ref_name(cfg.get("resources_server"))
            entry["allowed_agents"] = cfg.get("allowed_agents")
            entry["agents"] = _fronted_agents(cfg)
            entry["agent_server"] = _ref_name(cfg.get("agent_server"))
            environments[name] = entry
        else:
            entry["allowed_agents"] = cfg.get("allowed_agents")
            resources[name] = entry
    for name, env in environments.items():
        for agent in env["agents"]:
            if agent in agents:
                agents[agent].setdefault("_fronts", []).append(name)
    for agent in agents.values():
        fronts = agent.pop("_fronts", [])
        if len(fronts) == 1:
            agent["environment"] = fronts[0]
    normalised = {
        "agents": _clean(agents),
        "environments": _clean(environments),
        "resources_servers": _clean(resources),
        # The run-level routing keys sit beside the servers in NeMo Gym's global config.
        **{key: data[key] for key in ROUTING_KEYS if data.get(key) is not None},
    }
    return normalised, problems


def _fronted_agents(cfg: dict[str, Any]) -> list[str]:
    """Agents an environment server fronts: its `agent_server`, and every agent reference."""
    names = []
    ref = _ref_name(cfg.get("agent_server"))
    if ref is not None:
        names.append(ref)
    for value in cfg.values():
        if isinstance(value, dict) and value.get("type") == AGENTS:
            name = _ref_name(value)
            if name is not None:
                names.append(name)
    return list(dict.fromkeys(names))


def _clean(instances: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {k: v for k, v in cfg.items() if v is not None and v != []}
        for name, cfg in instances.items()
    }
