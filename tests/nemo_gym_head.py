"""A stand-in NeMo Gym head server: serves a global config at `GET /global_config_dict_yaml`."""

from __future__ import annotations

import json
from typing import Any

import yaml

from tests.helpers import QuietHandler, serve_in_thread


class StandInHeadServer:
    """Serves `config` as NeMo Gym's head server does: YAML text, JSON-encoded as a string.

    `raw_yaml=True` serves the YAML text itself, as some NeMo Gym versions and proxies do.
    """

    def __init__(self, config: dict[str, Any], raw_yaml: bool = False) -> None:
        text = yaml.safe_dump(config, sort_keys=False)
        body = (text if raw_yaml else json.dumps(text)).encode()
        self.requests: list[str] = []
        requests = self.requests

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                requests.append(self.path)
                if self.path != "/global_config_dict_yaml":
                    self.send_error(404)
                    return
                self.reply(200, body)

        self._server, self._thread, self.url = serve_in_thread(Handler)

    def __enter__(self) -> StandInHeadServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def as_nemo_gym(normalised: dict[str, Any], secret: str) -> dict[str, Any]:
    """NeMo Gym's global config equivalent to a normalised config, with secrets sprinkled in."""
    out: dict[str, Any] = {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "policy_api_key": secret,
        "policy_model": {
            "responses_api_models": {
                "openai_model": {"host": "127.0.0.1", "port": 1, "openai_api_key": secret}
            }
        },
    }

    def hostport(url: str) -> dict[str, Any]:
        host, port = url.removeprefix("http://").split(":")
        return {"host": host, "port": int(port)}

    for name, rs in normalised.get("resources_servers", {}).items():
        cfg = {**hostport(rs["url"]), "entrypoint": "app.py", "judge_api_key": secret}
        cfg.update({k: rs[k] for k in ("allowed_agents", "datasets") if k in rs})
        out[name] = {"resources_servers": {"my_verifier": cfg}}
    for name, agent in normalised["agents"].items():
        cfg = {
            **hostport(agent["url"]),
            "entrypoint": "app.py",
            "model_server": {"type": "responses_api_models", "name": "policy_model"},
        }
        if agent.get("resources_server"):
            cfg["resources_server"] = {
                "type": "resources_servers",
                "name": agent["resources_server"],
            }
        if agent.get("datasets"):
            cfg["datasets"] = agent["datasets"]
        out[name] = {"responses_api_agents": {agent.get("type", "simple_agent"): cfg}}
    for name, env in normalised.get("environments", {}).items():
        fronted = [a for a, cfg in normalised["agents"].items() if cfg.get("environment") == name]
        cfg = {**hostport(env["url"]), "entrypoint": "app.py"}
        if fronted:
            cfg["agent_server"] = {"type": "responses_api_agents", "name": fronted[0]}
        for extra in fronted[1:]:
            cfg[f"{extra}_ref"] = {"type": "responses_api_agents", "name": extra}
        if env.get("resources_server"):
            cfg["resources_server"] = {"type": "resources_servers", "name": env["resources_server"]}
        cfg.update({k: env[k] for k in ("allowed_agents", "datasets") if k in env})
        out[name] = {"environment_servers": {"legacy_agent": cfg}}
    return out
