"""Materialized task rows and NeMo Gym's environment routing modes, through `preprocess_examples`,
`plan_file` and the Python API's row checks (issue 38)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from producer.api.rows import Stamp, prepare_rows
from producer.config.loading import load_servers_config
from producer.config.nemo_gym import normalise
from producer.planning.planner import PlanContext, plan_file, preprocess_examples
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError
from schemas.settings import CollectionSettings
from tests.planning_helpers import Planner

CONFIG: dict[str, Any] = {
    "agents": {
        "math_agent": {"url": "http://m", "type": "simple_agent", "environment": "math_env"},
        "harbor_agent": {"url": "http://h", "type": "terminus"},
    },
    "environments": {
        "math_env": {"url": "http://me"},
        "harbor_env": {"url": "http://he", "agent_server": "harbor_agent", "resources_server": "rs"},
        "puzzle_env": {"url": "http://pe"},
    },
    "resources_servers": {"rs": {}},
    "environment_server_routes": {"harbor:tb": "harbor_env", "puzzles": "puzzle_env"},
}  # fmt: skip


def config(**top: Any) -> ServersConfig:
    return ServersConfig.model_validate({**copy.deepcopy(CONFIG), **top})


def flat(text: str = "q", **fields: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": text},
        "agent_ref": {"name": "math_agent"},
        **fields,
    }


def task(taskset: str, ident: str, **task_input: Any) -> dict[str, Any]:
    return {"task_id": {"taskset": taskset, "task_id": ident}, "task_input": task_input}


plan = Planner(config)
problems = plan.problems


def test_task_rows_route_by_taskset_and_mix_with_flat_rows() -> None:
    out = plan([flat(), task("harbor:tb", "7", cmd="ls"), task("puzzles", "7")], num_repeats=2)
    servers = [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX], r[F.ENVIRONMENT_SERVER]) for r in out]
    assert servers == [
        (0, 0, "math_env"), (0, 1, "math_env"),
        (1, 0, "harbor_env"), (1, 1, "harbor_env"),
        (2, 0, "puzzle_env"), (2, 1, "puzzle_env"),
    ]  # fmt: skip
    # A task row names no agent: its environment server runs it; its task is kept whole.
    assert all(F.AGENT_REF not in r for r in out[2:])
    assert out[2][F.TASK_ID] == {"taskset": "harbor:tb", "task_id": "7"}
    assert out[2][F.TASK_INPUT] == {"cmd": "ls"}
    assert F.dispatch_target(out[2]) == "harbor_env" and F.dispatch_target(out[0]) == "math_agent"


def test_a_task_is_numbered_by_its_task_id_not_its_line() -> None:
    rows = [task("puzzles", "a", v=1), task("puzzles", "b"), task("puzzles", "a", v=2)]
    out = plan(rows, num_repeats=2)
    keys = [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in out]
    # The second line of task "a" continues its rollouts, as a duplicate line does.
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]
    # The same task id in another taskset is another task.
    assert [r[F.TASK_INDEX] for r in plan([task("puzzles", "a"), task("harbor:tb", "a")])] == [0, 1]


def test_repeats_of_task_rows_are_keyed_by_taskset_and_routing_knobs_do_not_apply() -> None:
    out = plan(
        [task("puzzles", "1"), task("harbor:tb", "1"), flat()],
        num_repeats={"puzzles": 3, "_default": 1},
        fan_out={"puzzles": ["math_agent"]},
        agent_map={"_default": "harbor_agent"},
    )
    # The flat row is mapped (to harbor_agent, which harbor_env fronts); the task rows are not.
    assert [r[F.ENVIRONMENT_SERVER] for r in out] == ["puzzle_env"] * 3 + ["harbor_env"] * 2
    assert plan.warnings[-1:] == [
        "agent_map and fan_out do not apply to the 2 rows routed by environment server "
        "(materialized task rows, and flat rows in legacy mode)"
    ]


def test_nemo_gym_refusals_of_task_rows() -> None:
    text = problems([task("nowhere", "1"), task("puzzles", "2")], num_repeats_add_seed=True)
    assert (
        "<rows>:1,2, field 'num_repeats_add_seed': num_repeats_add_seed is not supported " in text
    )
    text = problems([task("nowhere", "1"), flat()])
    assert (
        "<rows>:1, field 'task_id.taskset': No environment server route is configured for "
        "taskset 'nowhere'"
    ) in text
    bad = [
        {"task_id": {"taskset": "", "task_id": 7}, "task_input": {}},
        {"task_id": {"taskset": "puzzles", "task_id": "1", "x": 1}, "task_input": []},
    ]
    text = problems(bad)
    assert "<rows>:1, field 'task_id.taskset': task_id.taskset must be a non-empty string" in text
    assert "<rows>:1, field 'task_id.task_id': task_id.task_id must be a non-empty string" in text
    assert "<rows>:2, field 'task_id': task_id has fields other than taskset and task_id" in text
    assert "<rows>:2, field 'task_input': task_input must be a JSON object" in text


def test_taskset_mode_refuses_flat_rows() -> None:
    text = problems([task("puzzles", "1"), flat()], environment_routing_mode="taskset")
    assert (
        "<rows>:2, field 'task_id': taskset routing requires rows containing task_id.taskset and "
        "task_input; use environment_routing_mode=agent to mix materialized and flat rows in one "
        "batch"
    ) in text
    assert len(plan([task("puzzles", "1")], environment_routing_mode="taskset")) == 1


def test_legacy_mode_sends_every_flat_row_to_the_named_server() -> None:
    unnamed = {"responses_create_params": {"input": "q"}}
    rows = [unnamed, flat(), task("puzzles", "1")]
    out = plan(rows, environment_routing_mode="legacy", environment_server_name="math_env")
    assert [r.get(F.AGENT_REF) for r in out] == [{"name": "math_agent"}] * 2 + [None]
    assert [r[F.ENVIRONMENT_SERVER] for r in out] == ["math_env", "math_env", "puzzle_env"]
    # A row that names no agent runs on the server's attributed agent: its agent_server.
    out = plan([unnamed], environment_routing_mode="legacy", environment_server_name="harbor_env")
    assert out[0][F.AGENT_REF] == {"name": "harbor_agent"}
    # math_agent is not one of the agents harbor_env fronts: NeMo Gym refuses the row.
    text = problems(
        [flat(task_source="elsewhere")],
        environment_routing_mode="legacy",
        environment_server_name="harbor_env",
    )
    assert (
        "Row agent_ref 'math_agent' is not an agent of environment server 'harbor_env': "
        "'harbor_agent'"
    ) in text
    assert (
        "Row task_source 'elsewhere' does not match environment server 'harbor_env' resources "
        "server 'rs'"
    ) in text
    text = problems(
        [{"responses_create_params": {"input": "q"}}],
        environment_routing_mode="legacy",
        environment_server_name="puzzle_env",
    )
    assert "no agent for this row: it names none, and environment server 'puzzle_env'" in text


def test_routing_keys_are_validated_where_they_were_set(tmp_path: Path) -> None:
    text = problems([flat()], environment_routing_mode="legacy")
    assert (
        "field 'environment_routing_mode': environment_server_name is required when "
        "environment_routing_mode=legacy"
    ) in text
    text = problems(
        [flat()], config(environment_server_routes=None), environment_routing_mode="taskset"
    )
    assert "environment_server_routes are required when environment_routing_mode=taskset" in text
    # Set in a config file: the message names the file and the line of the key.
    path = tmp_path / "servers.yaml"
    data = {**copy.deepcopy(CONFIG), "environment_routing_mode": "legacy"}
    data["environment_server_routes"] = {"puzzles": "puzle_env"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    line = path.read_text().splitlines().index("environment_routing_mode: legacy") + 1
    text = problems([flat()], load_servers_config(path))
    assert (
        f"{path}:{line}, field 'environment_routing_mode': environment_server_name is required "
        "when environment_routing_mode=legacy"
    ) in text
    assert (
        "field 'environment_server_routes': the route of taskset 'puzzles' names environment "
        "server 'puzle_env', which is not present in the running config (did you mean "
        "'puzzle_env'?)"
    ) in text
    # The run's settings win over the config's keys.
    out = plan([flat()], load_servers_config(path), environment_routing_mode="agent",
               environment_server_routes={})  # fmt: skip
    assert out[0][F.ENVIRONMENT_SERVER] == "math_env"


def test_allowed_agents_of_a_dataset_entry_matched_by_taskset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NEMO_GYM_ALLOW_UNSUPPORTED_PAIRING", raising=False)
    entry = {"name": "terminal-bench", "taskset": "harbor:tb", "allowed_agents": ["claude_code"]}
    cfg = ServersConfig.model_validate(
        {**copy.deepcopy(CONFIG), "resources_servers": {"rs": {"datasets": [entry]}}}
    )
    text = problems([task("harbor:tb", "1"), task("puzzles", "1")], cfg)
    assert (
        "<rows>:1: agent 'harbor_agent' (type 'terminus'), which environment server 'harbor_env' "
        "runs taskset 'harbor:tb' with, is not admitted by dataset 'terminal-bench' declared by "
        "'rs', which accepts only: claude_code"
    ) in text
    assert "<rows>:2" not in text
    assert len(plan([task("harbor:tb", "1")], cfg, allow_unsupported_pairing=True)) == 1
    # The server's resources server's allowed_agents apply to the agent that runs the episode.
    cfg = config(resources_servers={"rs": {"allowed_agents": ["claude_code"]}})
    assert "is not admitted by resources server 'rs'" in problems([task("harbor:tb", "1")], cfg)


def test_num_repeats_add_seed_seeds_each_repeat_of_a_flat_row() -> None:
    params: dict[str, Any] = {"input": "q", "metadata": {"extra_body": '{"top_k": 5}', "tag": "x"}}
    rows = [{"responses_create_params": params, "agent_ref": {"name": "math_agent"}}]
    out = plan(rows, num_repeats=3, num_repeats_add_seed=True)
    seeds = [json.loads(r[F.RESPONSES_CREATE_PARAMS]["metadata"]["extra_body"]) for r in out]
    assert seeds == [{"top_k": 5, "seed": 0}, {"top_k": 5, "seed": 1}, {"top_k": 5, "seed": 2}]
    assert out[1][F.RESPONSES_CREATE_PARAMS]["metadata"]["extra_body"] == '{"top_k": 5, "seed": 1}'
    assert out[0][F.RESPONSES_CREATE_PARAMS]["metadata"]["tag"] == "x"
    assert params["metadata"]["extra_body"] == '{"top_k": 5}'  # the input is not touched
    bad = [
        flat(),
        {**flat(), "responses_create_params": {"input": "q", "metadata": {"extra_body": "x"}}},
    ]
    assert "<rows>:2, field 'responses_create_params': num_repeats_add_seed needs" in problems(
        bad, num_repeats_add_seed=True
    )


def test_a_file_of_task_rows_plans_as_the_python_api_does(tmp_path: Path) -> None:
    rows = [flat(), task("puzzles", "1"), task("harbor:tb", "2", cmd="ls")]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    settings = CollectionSettings(num_repeats=2, interleave_by_agent=True)
    from_file = list(plan_file(str(path), config(), settings, PlanContext("r")))
    assert from_file == preprocess_examples(rows, config(), settings, run_id="r")
    # Round-robin across the servers that run the rows: the agent, and each environment server.
    assert [F.dispatch_target(r) for r in from_file[:3]] == [
        "math_agent",
        "puzzle_env",
        "harbor_env",
    ]


def test_run_examples_sends_task_rows_to_their_environment_server() -> None:
    rows = [task("puzzles", "1"), flat(), task("nowhere", "2")]
    with pytest.raises(PlanningError) as info:
        prepare_rows(rows, config(), CollectionSettings(), Stamp())
    assert "No environment server route is configured for taskset 'nowhere'" in str(info.value)
    prepared = prepare_rows(rows[:2], config(), CollectionSettings(), Stamp())
    assert prepared.agents == ["puzzle_env", "math_agent"]
    assert prepared.sent[0][F.ENVIRONMENT_SERVER] == "puzzle_env"
    assert F.ENVIRONMENT_SERVER not in rows[0]  # a copy was stamped


def test_nemo_gym_config_carries_routes_tasksets_and_agent_server() -> None:
    gym = {
        "harbor_agent": {"responses_api_agents": {"terminus": {"host": "h", "port": 1}}},
        "harbor_env": {
            "environment_servers": {
                "harbor_environment": {
                    "host": "h", "port": 2,
                    "agent_server": {"type": "responses_api_agents", "name": "harbor_agent"},
                    "datasets": [{"name": "tb", "taskset": "harbor:tb", "allowed_agents": ["terminus"]}],
                }
            }
        },
        "environment_routing_mode": "taskset",
        "environment_server_routes": {"harbor:tb": "harbor_env"},
    }  # fmt: skip
    data, found = normalise(gym, "gym.yaml")
    assert found == []
    cfg = ServersConfig.model_validate(data)
    assert cfg.environment_routing_mode == "taskset"
    assert cfg.environment_server_routes == {"harbor:tb": "harbor_env"}
    assert cfg.attributed_agent("harbor_env") == "harbor_agent"
    assert cfg.environments["harbor_env"].datasets[0].taskset == "harbor:tb"
    assert plan([task("harbor:tb", "1")], cfg)[0][F.ENVIRONMENT_SERVER] == "harbor_env"


def test_run_level_skills_stamp_flat_rows_and_are_refused_for_task_rows(tmp_path: Path) -> None:
    skills = tmp_path / "skills"
    (skills / "grep").mkdir(parents=True)
    (skills / "grep" / "SKILL.md").write_text(
        "---\nname: grep\ndescription: search files\nmetadata: {version: 2}\n---\nUse grep.\n"
    )
    out = plan([flat()], skills={"path": str(skills)}, num_repeats=2)
    ref = out[0][F.SKILLS_REF]
    assert ref["path"] == str(skills) and len(ref["hash"]) == 12
    assert ref["skills"] == [{"name": "grep", "description": "search files", "version": "2"}]
    assert out[1][F.SKILLS_REF] == ref
    # A skill changed in place is another skills_ref.
    (skills / "grep" / "helper.sh").write_text("#!/bin/sh\n")
    assert plan([flat()], skills={"path": str(skills)})[0][F.SKILLS_REF]["hash"] != ref["hash"]
    text = problems([flat(), task("puzzles", "1")], skills={"path": str(skills)})
    assert (
        "<rows>:2, field 'skills': run-level skills are not supported for materialized task rows"
    ) in text
    text = problems([flat()], skills={"path": str(tmp_path / "nowhere")})
    assert "field 'skills.path': the skills path" in text and "does not exist" in text
