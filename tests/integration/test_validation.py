"""Fail before dispatch (docs/how-to/routing.md): one test per validation rule, each through `rollouts run`.

Every test runs `python -m producer.cli run` as a subprocess against the real example agent and
environment servers, with a real Redis as the broker (`--no-wait`, no workers). A bad input must
exit 2 with one message that names every offending line and no other, while no server received
a request, nothing reached the broker and the run directory was not touched. The control test
shows the same harness does see a dispatch when the input is good.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import yaml

from examples.servers import RunningServers
from examples.tasks import task_row
from tests.helpers import agent_stats, demo_rows

pytestmark = pytest.mark.integration


def named_lines(stderr: str, data: Path) -> set[int]:
    """Every line number the error message names for `data` (`rows.jsonl:3,5,7-9`)."""
    lines: set[int] = set()
    for spec in re.findall(re.escape(str(data)) + r":([0-9][0-9,\-]*)", stderr):
        for part in spec.strip(",").split(","):
            first, _, last = part.partition("-")
            lines.update(range(int(first), int(last or first) + 1))
    return lines


Ran = tuple[subprocess.CompletedProcess[str], Path, Path]
"""What `rollouts run` did: its process, its input file, its run directory."""


@dataclass
class Cli:
    """`rollouts run --no-wait` against the demo servers and the session Redis (no worker), and
    what a refused run must have left untouched."""

    servers: RunningServers
    redis_url: str
    tmp_path: Path

    @property
    def input(self) -> Path:
        """Where `run` writes the rows (in the test's folder)."""
        return self.tmp_path / "rows.jsonl"

    def run(
        self,
        config: dict[str, Any] | str | None,
        rows: list[Any],
        *extra: str,
        folder: Path | None = None,
        out: Path | None = None,
    ) -> Ran:
        """`rollouts run` on `rows` (dicts, or raw strings written as they are) written in
        `folder` (the test's), with `config` (the servers' own when None)."""
        folder = folder or self.tmp_path
        if not isinstance(config, str):
            config_path = folder / "servers.yaml"
            config_path.write_text(yaml.safe_dump(config or self.servers.config(), sort_keys=False))
            config = str(config_path)
        data = folder / "rows.jsonl"
        with open(data, "wb") as f:
            for row in rows:
                f.write((row.encode() if isinstance(row, str) else orjson.dumps(row)) + b"\n")
        out = out or folder / "run"
        cmd = [
            sys.executable, "-m", "producer.cli", "run", "--config", config, "--input", str(data),
            "--output-dir", str(out), "--broker", self.redis_url, "--no-wait", *extra,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return proc, data, out

    def refused(
        self,
        config: dict[str, Any] | str | None,
        rows: list[Any],
        bad_lines: set[int],
        *fragments: str,
        extra: tuple[str, ...] = (),
        out: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """`run`, refused (`assert_refused`)."""
        ran = self.run(config, rows, *extra, out=out)
        self.assert_refused(ran, bad_lines, *fragments)
        return ran[0]

    def assert_refused(self, ran: Ran, bad_lines: set[int], *fragments: str) -> None:
        """Exit 2, one message naming exactly `bad_lines` of the input and holding each of
        `fragments`, no run directory, nothing dispatched."""
        proc, data, out = ran
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert named_lines(proc.stderr, data) == bad_lines, proc.stderr
        for fragment in fragments:
            assert fragment in proc.stderr, proc.stderr
        assert not out.exists()
        self.nothing_dispatched()

    def nothing_dispatched(self) -> None:
        for agent in self.servers.agents:
            assert agent_stats(self.servers, agent)["requests"] == 0
        assert all(env.requests == env.episodes == 0 for env in self.servers.environments.values())
        r = redis.Redis.from_url(self.redis_url)
        try:
            assert r.dbsize() == 0, r.keys()
        finally:
            r.close()


@pytest.fixture
def cli(servers: RunningServers, redis_url: str, tmp_path: Path) -> Cli:
    return Cli(servers, redis_url, tmp_path)


def rows_with(bad: dict[int, Any], n: int = 6) -> list[Any]:
    """n good demo rows with the rows of `bad` (1-based line -> row) in place."""
    rows: list[Any] = list(demo_rows(n))
    for line, row in bad.items():
        rows[line - 1] = row
    return rows


def rcp(text: str = "x") -> dict[str, Any]:
    return {"input": [{"role": "user", "content": text}]}


def with_resources(servers: RunningServers) -> dict[str, Any]:
    """The demo config plus a resources server `math_rs` that math_agent binds."""
    config = copy.deepcopy(servers.config())
    config["agents"]["math_agent"]["resources_server"] = "math_rs"
    config["resources_servers"] = {"math_rs": {"allowed_agents": ["simple_agent"]}}
    return config


def test_control_good_input_is_dispatched(cli: Cli, redis_url: str) -> None:
    proc, _, out = cli.run(None, demo_rows(6))

    assert proc.returncode == 0, proc.stderr
    assert "enqueued 6 rollouts" in proc.stdout
    assert (out / "rollouts-0_materialized_inputs.jsonl").exists()
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.dbsize() > 0
    finally:
        r.close()


def test_line_that_is_not_json(cli: Cli) -> None:
    rows = rows_with({2: '{"responses_create_params": ', 5: "not json at all"})
    cli.refused(None, rows, {2, 5}, "not valid JSON")


def test_row_that_is_not_an_object(cli: Cli) -> None:
    rows = rows_with({1: "[1, 2]", 4: '"text"', 6: "42"})
    cli.refused(None, rows, {1, 4, 6}, "must be a JSON object")


def test_row_without_responses_create_params(cli: Cli) -> None:
    rows = rows_with({3: {"agent_ref": {"name": "math_agent"}}, 4: {"task_source": "math_env"}})
    cli.refused(None, rows, {3, 4}, "missing responses_create_params")


def test_row_with_no_resolvable_agent(cli: Cli) -> None:
    rows = rows_with(
        {2: {"responses_create_params": rcp()}, 6: {"responses_create_params": rcp("y")}}
    )
    cli.refused(None, rows, {2, 6}, "no agent for this row")


def test_agent_absent_from_the_config_with_did_you_mean(cli: Cli) -> None:
    rows = rows_with(
        {
            1: {"responses_create_params": rcp(), "agent_ref": {"name": "math_agnet"}},
            5: {"responses_create_params": rcp("z"), "agent_ref": {"name": "math_agnet"}},
        }
    )
    cli.refused(None, rows, {1, 5}, "'math_agnet'", "did you mean 'math_agent'?")


def test_agent_map_naming_an_absent_agent(cli: Cli) -> None:
    # Every count_agent row (even lines) is re-routed to an agent the config lacks.
    cli.refused(
        None,
        demo_rows(6),
        {2, 4, 6},
        "agent_map['count_agent']",
        extra=("+agent_map.count_agent=cnt_agent",),
    )


def test_unknown_task_source(cli: Cli) -> None:
    rows = rows_with(
        {
            2: {"responses_create_params": rcp(), "task_source": "math_enf"},
            3: {"responses_create_params": rcp("q"), "task_source": "nowhere"},
        }
    )
    cli.refused(None, rows, {2, 3}, "did you mean 'math_env'?", "'nowhere'")


def test_unroutable_task_source(cli: Cli, servers: RunningServers) -> None:
    # Both agents bind shared_rs, and nothing pins one of them: task_source alone cannot choose.
    config = copy.deepcopy(servers.config())
    for agent in config["agents"].values():
        agent["resources_server"] = "shared_rs"
    config["resources_servers"] = {"shared_rs": {}, "lonely_rs": {}}
    rows = rows_with(
        {
            3: {"responses_create_params": rcp(), "task_source": "shared_rs"},
            4: {"responses_create_params": rcp("b"), "task_source": "lonely_rs"},
        }
    )
    cli.refused(
        config,
        rows,
        {3, 4},
        "agents count_agent, math_agent are bound",
        "no agent is bound to it",
        "+agent_map.shared_rs=<agent>",
    )


def test_conflicting_dataset_pins(cli: Cli, servers: RunningServers) -> None:
    config = with_resources(servers)
    config["resources_servers"]["math_rs"]["datasets"] = [
        {"name": "gsm8k", "agent": "math_agent"},
        {"name": "counting", "agent": "count_agent"},
    ]
    rows = rows_with({1: {"responses_create_params": rcp(), "task_source": "math_rs"}})
    rows.append({"responses_create_params": rcp("c"), "task_source": "math_rs"})
    cli.refused(config, rows, {1, 7}, "pin conflicting agents (count_agent, math_agent)")


def test_allowed_agents_of_the_task_source(cli: Cli, servers: RunningServers) -> None:
    # Rows from math_rs (which admits only judge_agent) are sent to count_agent by agent_ref.
    config = with_resources(servers)
    config["resources_servers"]["math_rs"]["allowed_agents"] = ["judge_agent"]
    config["agents"]["math_agent"].pop("resources_server")
    rows = rows_with(
        {
            2: {"responses_create_params": rcp(), "task_source": "math_rs", "agent_ref": {"name": "count_agent"}},
            5: {"responses_create_params": rcp("t"), "task_source": "math_rs", "agent_ref": {"name": "math_agent"}},
        }
    )  # fmt: skip
    cli.refused(
        config,
        rows,
        {2, 5},
        "resources server 'math_rs' (the row's task_source), which accepts only: judge_agent",
    )


def test_allowed_agents_of_the_bound_environment(cli: Cli, servers: RunningServers) -> None:
    config = copy.deepcopy(servers.config())
    config["environments"]["count_env"]["allowed_agents"] = ["tool_agent"]
    cli.refused(
        config,
        demo_rows(5),
        {2, 4},
        "environment 'count_env', which fronts agent 'count_agent', which accepts only: tool_agent",
    )


def test_allowed_agents_of_the_bound_resources_server(cli: Cli, servers: RunningServers) -> None:
    config = with_resources(servers)
    config["resources_servers"]["math_rs"]["allowed_agents"] = ["tool_agent"]
    cli.refused(
        config, demo_rows(4), {1, 3}, "resources server 'math_rs', which agent 'math_agent' binds"
    )


def test_allowed_agents_of_the_dataset_entry(cli: Cli, servers: RunningServers) -> None:
    # An agent edited to another harness after the dataset admitted one (the seeds' Harbor case):
    # the entry of the row's task_source, and every entry the agent itself declares.
    config = copy.deepcopy(servers.config())
    config["agents"]["math_agent"]["type"] = "codex_agent"
    config["environments"]["math_env"]["allowed_agents"] = None
    config["environments"]["math_env"]["datasets"] = [
        {"name": "harbor", "allowed_agents": ["simple_agent"]}
    ]
    config["agents"]["count_agent"]["datasets"] = [
        {"name": "counting", "allowed_agents": ["counting_agent"]}
    ]
    rows = rows_with({3: {"responses_create_params": rcp(), "task_source": "math_env"}})
    cli.refused(
        config,
        rows,
        {2, 3, 4, 6},
        "dataset 'harbor' declared by 'math_env', which accepts only: simple_agent",
        "dataset 'counting' declared by agent 'count_agent', which accepts only: counting_agent",
    )


def test_pairing_bypass_lets_the_run_through(cli: Cli, servers: RunningServers) -> None:
    config = copy.deepcopy(servers.config())
    config["environments"]["count_env"]["allowed_agents"] = ["tool_agent"]
    proc, _, out = cli.run(config, demo_rows(4), "--allow-unsupported-pairing")
    assert proc.returncode == 0, proc.stderr
    assert (out / "rollouts-0_materialized_inputs.jsonl").exists()


def test_agent_without_an_environment_server(cli: Cli, servers: RunningServers) -> None:
    config = copy.deepcopy(servers.config())
    config["agents"]["count_agent"]["environment"] = "count_envv"
    cli.refused(
        config,
        demo_rows(4),
        {2, 4},
        "Agent 'count_agent' has no environment server, so collection cannot reach it: it names "
        "environment 'count_envv', which is not in the config",
    )


def test_agent_with_several_environment_servers(cli: Cli, servers: RunningServers) -> None:
    config = copy.deepcopy(servers.config())
    del config["agents"]["math_agent"]["environment"]
    config["environments"]["math_env"]["agents"] = ["math_agent"]
    config["environments"]["count_env"]["agents"] = ["math_agent"]
    cli.refused(
        config,
        demo_rows(5),
        {1, 3, 5},
        "Agent 'math_agent' is fronted by several environment servers: ['count_env', 'math_env']. "
        "Rows that route by agent cannot choose between them.",
    )


def test_invalid_rollout_id(cli: Cli) -> None:
    rows = rows_with({})
    rows[1] = {**rows[1], "_ng_rollout_id": ".hidden"}
    rows[2] = {**rows[2], "_ng_rollout_id": "has space"}
    rows[3] = {**rows[3], "_ng_rollout_id": "fine-id"}
    rows[4] = {**rows[4], "_ng_rollout_id": "fine-id"}
    cli.refused(None, rows, {2, 3, 5}, "invalid rollout id '.hidden'", "is already used on line 4")


def test_invalid_shard_label(cli: Cli) -> None:
    rows = rows_with({4: "{broken"})
    cli.refused(None, rows, {4}, "invalid shard label 'a/b'", extra=("--shard", "a/b"))


def test_run_directory_holding_another_runs_shard(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    first, _, out = cli.run(None, demo_rows(4))
    assert first.returncode == 0, first.stderr
    manifest = orjson.loads((out / "rollouts-0_manifest.json").read_bytes())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()

    second = tmp_path / "second"
    second.mkdir()
    proc, data, _ = cli.run(None, rows_with({2: "[]"}), folder=second, out=out)

    assert proc.returncode == 2, proc.stderr
    assert f"already holds shard 0 of run {manifest['run_id']}" in proc.stderr
    assert "--overwrite" in proc.stderr
    assert named_lines(proc.stderr, data) == {2}
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    cli.nothing_dispatched()

    # Alone, the same problem is still exit 2; --overwrite replaces the earlier run.
    alone, _, _ = cli.run(None, demo_rows(4), folder=second, out=out)
    assert alone.returncode == 2 and manifest["run_id"] in alone.stderr
    cli.nothing_dispatched()
    replaced, _, _ = cli.run(None, demo_rows(4), "--overwrite", folder=second, out=out)
    assert replaced.returncode == 0, replaced.stderr
    assert (
        orjson.loads((out / "rollouts-0_manifest.json").read_bytes())["run_id"]
        != manifest["run_id"]
    )


def test_every_problem_in_one_error(cli: Cli) -> None:
    rows = rows_with(
        {
            2: "{oops",
            3: {"agent_ref": {"name": "math_agent"}},
            5: {"responses_create_params": rcp(), "agent_ref": {"name": "nobody"}},
            7: {"responses_create_params": rcp(), "task_source": "nowhere"},
            9: {"responses_create_params": rcp(), "agent_ref": {"name": "math_agent"}, "_ng_rollout_id": "-x"},
        },
        n=10,
    )  # fmt: skip
    proc = cli.refused(
        None,
        rows,
        {2, 3, 5, 7, 9},
        "not valid JSON",
        "missing responses_create_params",
        "'nobody'",
        "'nowhere'",
        "invalid rollout id '-x'",
        "invalid shard label 'bad label'",
        extra=("--shard", "bad label"),
    )
    assert proc.stderr.count("error:") == 1


def test_shard_label_ending_in_an_artifact_suffix(cli: Cli, redis_url: str) -> None:
    proc = cli.refused(
        None,
        demo_rows(4),
        set(),
        "invalid shard label '0_failures' (--shard): it ends in '_failures'",
        extra=("--shard", "0_failures"),
    )
    assert proc.stderr.count("error:") == 1

    # Beside a shard 0, a label naming its inputs leaves every file of it as it was.
    first, _, out = cli.run(None, demo_rows(4))
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()
    label = "0_materialized_inputs"
    proc, _, _ = cli.run(None, demo_rows(4), "--shard", label, "--overwrite")
    assert proc.returncode == 2, proc.stderr
    assert (
        f"invalid shard label '{label}' (--shard): it ends in '_materialized_inputs'" in proc.stderr
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    cli.nothing_dispatched()


def test_shard_label_too_long(cli: Cli) -> None:
    proc = cli.refused(
        None,
        demo_rows(4),
        set(),
        "(--shard): 300 characters, at most 128 allowed",
        extra=("--shard", "s" * 300),
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [("_ng_failure_class", "agent_run_error"), ("_ng_no_persist", True), ("_ng_attempt_index", 2)],
)
def test_reserved_field_in_an_input_row(cli: Cli, field: str, value: Any) -> None:
    rows = rows_with({})
    for line in (2, 5):
        rows[line - 1] = {**rows[line - 1], field: value}
    cli.refused(None, rows, {2, 5}, f"field {field!r}: reserved field", "fed back as input")


def test_row_nested_too_deep(cli: Cli) -> None:
    good = orjson.dumps(demo_rows(1)[0])
    deep = good[:-1] + b', "deep": ' + b"[" * 600 + b"1" + b"]" * 600 + b"}"
    proc = cli.refused(
        None,
        rows_with({3: deep.decode()}),
        {3},
        "the row nests objects and arrays more than 100 levels deep",
    )
    assert "Traceback" not in proc.stderr


def test_row_larger_than_max_row_bytes(cli: Cli) -> None:
    big = {**demo_rows(1)[0], "padding": "x" * 50_000}
    cli.refused(
        None,
        rows_with({2: big, 6: big}),
        {2, 6},
        "the row is larger than max_row_bytes (20000 bytes)",
        extra=("+max_row_bytes=20000",),
    )


# --- NeMo Gym's routing mistakes (issue 38) -----------------------------------------------------


def with_routes(servers: RunningServers, **top: Any) -> dict[str, Any]:
    """The demo config whose math_env runs the episodes of taskset `arith:v1`, plus `top`."""
    return {**servers.config(), "environment_server_routes": {"arith:v1": "math_env"}, **top}


def config_line(config: Path, key: str) -> str:
    """`servers.yaml:N`, N the line of the top-level `key` in the config written by `run_cli`."""
    lines = config.read_text().splitlines()
    return f"{config}:{next(i for i, line in enumerate(lines, 1) if line.startswith(key + ':'))}"


def test_a_task_row_whose_taskset_has_no_route(cli: Cli, servers: RunningServers) -> None:
    rows = rows_with(
        {2: task_row("arith:v1", "arithmetic", 1), 5: task_row("arith:v2", "arithmetic", 2)}
    )
    cli.refused(
        with_routes(servers),
        rows,
        {5},
        f"{cli.input}:5, field 'task_id.taskset': No environment server route is configured for "
        "taskset 'arith:v2'",
    )


def test_taskset_mode_with_a_flat_row(cli: Cli, servers: RunningServers) -> None:
    rows = [task_row("arith:v1", "arithmetic", i) for i in range(4)]
    rows[2] = demo_rows(1)[0]
    config = with_routes(servers, environment_routing_mode="taskset")
    cli.refused(
        config,
        rows,
        {3},
        f"{cli.input}:3, field 'task_id': taskset routing requires rows containing task_id.taskset and "
        "task_input; use environment_routing_mode=agent to mix materialized and flat rows in one "
        "batch",
    )


def test_legacy_mode_without_a_server_name(
    cli: Cli, servers: RunningServers, tmp_path: Path
) -> None:
    ran = cli.run(with_routes(servers, environment_routing_mode="legacy"), demo_rows(4))
    proc = ran[0]
    where = config_line(tmp_path / "servers.yaml", "environment_routing_mode")
    cli.assert_refused(
        ran, set(),
        f"{where}, field 'environment_routing_mode': environment_server_name is required when "
        "environment_routing_mode=legacy",
    )  # fmt: skip
    assert proc.stderr.count("\n  - ") == 1  # one problem, on one line


def test_taskset_mode_without_routes(cli: Cli, servers: RunningServers, tmp_path: Path) -> None:
    config = {**servers.config(), "environment_routing_mode": "taskset"}
    rows = [task_row("arith:v1", "arithmetic", 1)]
    ran = cli.run(config, rows)
    where = config_line(tmp_path / "servers.yaml", "environment_routing_mode")
    cli.assert_refused(
        ran, {1},
        f"{where}, field 'environment_routing_mode': environment_server_routes are required "
        "when environment_routing_mode=taskset",
        f"{cli.input}:1, field 'task_id.taskset': No environment server route is configured",
    )  # fmt: skip
    # The same mistake made on the command line names the key.
    cli.refused(
        None,
        rows,
        {1},
        "field 'environment_routing_mode': environment_server_routes are required",
        extra=("+environment_routing_mode=taskset",),
        out=tmp_path / "run2",
    )


def test_routing_keys_as_overrides_run_a_legacy_batch(cli: Cli) -> None:
    rows = [*demo_rows(2), task_row("arith:v1", "arithmetic", 1)]
    rows[1] = {k: v for k, v in rows[1].items() if k != "agent_ref"}
    proc, _, out = cli.run(
        None,
        rows,
        "+environment_routing_mode=legacy",
        "+environment_server_name=math_env",
        "+environment_server_routes={arith:v1: count_env}",
    )
    assert proc.returncode == 0, proc.stderr
    planned = [
        orjson.loads(line)
        for line in (out / "rollouts-0_materialized_inputs.jsonl").read_bytes().splitlines()
    ]
    planned.sort(key=lambda r: r["_ng_task_index"])  # run order round-robins across servers
    assert [(r.get("agent_ref"), r["_ng_environment_server"]) for r in planned] == [
        ({"name": "math_agent"}, "math_env"),
        ({"name": "math_agent"}, "math_env"),  # no agent named: math_env's own
        (None, "count_env"),
    ]
