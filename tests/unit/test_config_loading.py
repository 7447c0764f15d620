"""Servers config: both formats of docs/reference/servers-config.md, head-server discovery, secrets (acceptance 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from producer.config.loading import (
    load_head_server_config,
    load_run_config,
    load_servers_config,
    parse_servers_config,
)
from producer.planning.planner import PlanContext, write_plan
from schemas.config import ServersConfig
from schemas.errors import PlanningError, UsageError
from schemas.settings import CollectionSettings
from tests.nemo_gym_head import StandInHeadServer, as_nemo_gym

SECRET = "sk-live-0123456789abcdef"

NORMALISED: dict[str, Any] = {
    "agents": {
        "math_agent": {"url": "http://127.0.0.1:9101", "type": "simple_agent",
                       "environment": "math_env", "resources_server": "math_rs"},
        "count_agent": {"url": "http://127.0.0.1:9102", "type": "simple_agent",
                        "environment": "count_env"},
        "code_agent": {"url": "http://127.0.0.1:9103", "type": "codex_agent",
                       "datasets": [{"name": "swe", "allowed_agents": ["codex_agent"]}]},
    },
    "environments": {
        "math_env": {"url": "http://127.0.0.1:9201", "resources_server": "math_rs",
                     "allowed_agents": ["simple_agent"]},
        "count_env": {"url": "http://127.0.0.1:9202",
                      "datasets": [{"name": "counting", "agent": "count_agent"}]},
    },
    "resources_servers": {
        "math_rs": {"url": "http://127.0.0.1:9301", "allowed_agents": ["simple_agent"],
                    "datasets": [{"name": "gsm8k", "agent": "math_agent"}]},
    },
}  # fmt: skip


def rows_file(tmp_path: Path) -> str:
    rows = []
    for i in range(12):
        r: dict[str, Any] = {"responses_create_params": {"input": f"q{i % 9}"}}
        match i % 4:
            case 0:
                r["task_source"] = "math_rs"
            case 1:
                r["task_source"] = "count_env"
            case 2:
                r["agent_ref"] = {"name": "code_agent"}
            case _:
                r["task_source"] = "math_env"
        rows.append(r)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


def planned_bytes(config: ServersConfig, rows: str, out: Path) -> bytes:
    settings = CollectionSettings(
        num_repeats={"code_agent": 1, "_default": 2}, interleave_by_agent=True
    )
    write_plan(rows, str(out), config, settings, PlanContext("run-x"))
    return out.read_bytes()


@pytest.mark.parametrize("raw_yaml", [False, True], ids=["json-string", "yaml-text"])
def test_nemo_gym_file_and_head_server_plan_like_the_normalised_config(
    tmp_path: Path, raw_yaml: bool
) -> None:
    rows = rows_file(tmp_path)
    normalised_path = tmp_path / "normalised.yaml"
    normalised_path.write_text(yaml.safe_dump(NORMALISED))
    gym = as_nemo_gym(NORMALISED, SECRET)
    gym_path = tmp_path / "gym.yaml"
    gym_path.write_text(yaml.safe_dump(gym))

    expected = planned_bytes(load_servers_config(normalised_path), rows, tmp_path / "a.jsonl")
    from_file = load_servers_config(gym_path)
    with StandInHeadServer(gym, raw_yaml=raw_yaml) as head:
        from_head = load_run_config(None, head.url)
        assert head.requests == ["/global_config_dict_yaml"]

    assert len(expected.splitlines()) == 21
    assert planned_bytes(from_file, rows, tmp_path / "b.jsonl") == expected
    assert planned_bytes(from_head, rows, tmp_path / "c.jsonl") == expected
    for config in (from_file, from_head):
        assert set(config.agents) == set(NORMALISED["agents"])
        assert config.agents["math_agent"].environment == "math_env"
        assert config.environments["math_env"].agents == ["math_agent"]
        assert SECRET not in orjson.dumps(config.model_dump()).decode()


def test_nemo_gym_agent_fronted_by_two_environment_servers(tmp_path: Path) -> None:
    gym = {
        "a": {"responses_api_agents": {"simple_agent": {"host": "h", "port": 1}}},
        "e1": {"environment_servers": {"x": {"host": "h", "port": 2, "agent_server": {"name": "a"}}}},
        "e2": {"environment_servers": {"y": {"host": "h", "port": 3,
                                             "inner": {"type": "responses_api_agents", "name": "a"}}}},
    }  # fmt: skip
    config = parse_servers_config(gym, "gym")
    assert config.agents["a"].environment is None
    assert config.environments_of("a") == ["e1", "e2"]


def test_nemo_gym_servers_without_address_are_reported(tmp_path: Path) -> None:
    gym = {
        "a": {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
        "e": {"environment_servers": {"x": {"host": "${oc.env:HOST}", "port": 2}}},
    }
    with pytest.raises(PlanningError) as info:
        parse_servers_config(gym, "gym.yaml")
    text = str(info.value)
    assert "gym.yaml, field 'a.responses_api_agents.simple_agent': no host and port" in text
    assert "field 'e.environment_servers.x'" in text


def test_secrets_are_redacted_in_the_snapshot() -> None:
    config = ServersConfig.model_validate(
        {
            "agents": {
                "a": {"url": "http://user:hunter2@h:1", "api_key": SECRET,
                      "headers": {"Authorization-Token": SECRET}},
            },
        }
    )  # fmt: skip
    snapshot = orjson.dumps(config.redacted()).decode()
    assert SECRET not in snapshot and "hunter2" not in snapshot
    assert config.agents["a"].url == "http://user:hunter2@h:1"  # calls still use the real URL
    assert ServersConfig.model_validate(config.redacted()).agents["a"].url == "http://user:***@h:1"


def test_instance_names_must_be_unique_across_kinds() -> None:
    with pytest.raises(ValueError, match="used more than once: x"):
        ServersConfig.model_validate(
            {"agents": {"x": {"url": "u"}}, "environments": {"x": {"url": "v"}}}
        )


def test_head_server_failures_are_usage_errors(tmp_path: Path) -> None:
    with StandInHeadServer({}) as head:
        url = head.url
    with pytest.raises(UsageError, match="cannot read the config from head server"):
        load_head_server_config(url)
    with StandInHeadServer({"policy_api_key": SECRET}) as head, pytest.raises(UsageError) as info:
        load_head_server_config(head.url + "/nope")
    assert "HTTP 404" in str(info.value) and SECRET not in str(info.value)


def test_yaml_errors_do_not_quote_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"agents:\n  a: {{url: x, api_key: {SECRET}\n")
    with pytest.raises(PlanningError) as info:
        load_servers_config(path)
    assert "not valid YAML" in str(info.value) and SECRET not in str(info.value)


def test_exactly_one_config_source() -> None:
    with pytest.raises(UsageError, match="exactly one of --config and --head-server"):
        load_run_config(None, None)
    with pytest.raises(UsageError, match="exactly one"):
        load_run_config("a.yaml", "http://h:1")


@pytest.mark.parametrize(
    "name",
    [
        "Authorization", "X-Api-Key", "openai_key", "private_key", "aws_access_key_id",
        "aws_secret_access_key", "credentials", "passwd", "hf_access_key", "api_key",
        "hf_token", "client_secret", "Proxy-Authorization",
    ],
)  # fmt: skip
def test_secrets_are_masked_by_key_and_header_name_in_any_case(name: str) -> None:
    config = ServersConfig.model_validate(
        {"agents": {"a": {"url": "http://h:1", name: SECRET, "headers": {name.upper(): SECRET}}}}
    )
    assert SECRET not in orjson.dumps(config.redacted()).decode()


def test_credential_values_and_query_parameters_are_masked() -> None:
    config = ServersConfig.model_validate(
        {
            "agents": {
                "a": {"url": f"http://h:1/v1?api_key={SECRET}&model=m",
                      "headers": {"X-Forward": f"Bearer {SECRET}"}},
            },
        }
    )  # fmt: skip
    redacted: dict[str, Any] = config.redacted()  # read by path below
    assert SECRET not in orjson.dumps(redacted).decode()
    assert redacted["agents"]["a"]["url"] == "http://h:1/v1?api_key=***&model=m"


def test_settings_that_only_look_alike_are_kept() -> None:
    config = ServersConfig.model_validate(
        {"agents": {"a": {"url": "http://h:1", "max_tokens": 512, "tokenizer": "t", "keys": 2}}}
    )
    redacted: dict[str, Any] = config.redacted()
    kept = redacted["agents"]["a"]
    assert {k: kept[k] for k in ("url", "max_tokens", "tokenizer", "keys")} == {
        "url": "http://h:1",
        "max_tokens": 512,
        "tokenizer": "t",
        "keys": 2,
    }
