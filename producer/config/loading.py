"""Loading the servers config (`--config` file or `--head-server`) into its normalised form.

Both formats of docs/reference/servers-config.md are accepted: the normalised one and NeMo Gym's global config
(`producer/config/nemo_gym.py`), read from a file or from a running NeMo Gym head server's
`GET /global_config_dict_yaml`. Messages never quote the config's text: it may hold keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import ValidationError

from producer.config.facts import config_facts
from producer.config.nemo_gym import is_nemo_gym_config, normalise
from schemas.config import ROUTING_KEYS, ServersConfig, redact_url
from schemas.errors import PlanningError, Problem, UsageError

HEAD_SERVER_PATH = "/global_config_dict_yaml"
HEAD_SERVER_TIMEOUT_S = 30.0


def _located(exc: ValidationError, source: str) -> PlanningError:
    problems = [
        Problem(message=err["msg"], file=source, field=".".join(str(p) for p in err["loc"]))
        for err in exc.errors()
    ]
    return PlanningError(problems, header=f"invalid servers config {source}")


def parse_servers_config(
    data: Any, source: str, lines: dict[str, int] | None = None
) -> ServersConfig:
    """Validate an already parsed config document, in either format; `lines`: the line of each
    top-level key in the file (for messages about the run-level keys it sets)."""
    if not isinstance(data, dict):
        raise PlanningError(
            [Problem("the config must be a mapping", file=source)], header="invalid servers config"
        )
    facts = config_facts(data)
    if is_nemo_gym_config(data):
        data, problems = normalise(data, source)
        if problems:
            raise PlanningError(problems, header=f"invalid servers config {source}")
    try:
        config = ServersConfig.model_validate(data).located(source, lines or {})
    except ValidationError as exc:
        raise _located(exc, source) from None
    return config.with_written_facts(facts)


def top_level_lines(text: str) -> dict[str, int]:
    """The 1-based line of each top-level key of a YAML mapping document ({} for anything else)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {
        str(key.value): key.start_mark.line + 1
        for key, _ in node.value
        if isinstance(key, yaml.ScalarNode)
    }


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(exc, "problem", None) or type(exc).__name__
        raise PlanningError(
            [Problem(f"not valid YAML: {what}", file=source, line=line)],
            header="invalid servers config",
        ) from None


def load_servers_config(path: str | Path) -> ServersConfig:
    """Read a YAML servers config; every problem is reported with the file and field."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlanningError(
            [Problem(f"cannot read: {exc.strerror}", file=source)], header="invalid servers config"
        ) from None
    data = _parse_yaml(text, source)
    routing = isinstance(data, dict) and any(key in data for key in ROUTING_KEYS)
    return parse_servers_config(data, source, top_level_lines(text) if routing else None)


def fetch_head_server_config(url: str, timeout_s: float = HEAD_SERVER_TIMEOUT_S) -> dict[str, Any]:
    """NeMo Gym's resolved global config, as its head server serves it."""
    base = url.rstrip("/")
    source = f"head server {redact_url(base)}"
    try:
        with httpx.Client(timeout=timeout_s) as client:
            response = client.get(base + HEAD_SERVER_PATH)
    except httpx.HTTPError as exc:
        raise UsageError(
            f"cannot read the config from {source}: {type(exc).__name__}; is it running?"
        ) from None
    if response.status_code != 200:
        raise UsageError(
            f"cannot read the config from {source}: GET {HEAD_SERVER_PATH} answered HTTP "
            f"{response.status_code}"
        )
    data = _parse_yaml(response.text, source)
    # NeMo Gym's head server answers with the YAML text as a JSON string.
    if isinstance(data, str):
        data = _parse_yaml(data, source)
    if not isinstance(data, dict):
        raise PlanningError(
            [Problem("the served config is not a mapping", file=source)],
            header="invalid servers config",
        )
    return data


def load_head_server_config(url: str) -> ServersConfig:
    """The servers config discovered from a running NeMo Gym head server (`--head-server`)."""
    return parse_servers_config(fetch_head_server_config(url), f"head server {redact_url(url)}")


def load_run_config(config_path: str | None, head_server: str | None) -> ServersConfig:
    """The config of `rollouts run`: from `--config` or from `--head-server`, exactly one."""
    if (config_path is None) == (head_server is None):
        raise UsageError("give exactly one of --config and --head-server")
    if head_server is not None:
        return load_head_server_config(head_server)
    assert config_path is not None
    return load_servers_config(config_path)
