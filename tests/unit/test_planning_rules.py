"""The planning rules of docs/how-to/routing.md, one at a time, through `preprocess_examples` and `plan_file`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from producer.planning.planner import PlanContext, plan_file, preprocess_examples
from schemas import fields as F
from schemas.errors import PlanningError
from schemas.settings import CollectionSettings
from tests.planning_helpers import Planner, config, ref, row

plan = Planner(config)
problems = plan.problems


def keys(out: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    return [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX], r[F.AGENT_REF]["name"]) for r in out]


# --- agent precedence ---------------------------------------------------------------------


def test_agent_precedence_follows_spec_order() -> None:
    r = row(agent_ref=ref("math_agent"), task_source="code_env")
    assert keys(plan([r]))[0][2] == "math_agent"  # the row's agent_ref beats task_source
    assert (
        keys(plan([r], agent_name="solo_agent"))[0][2] == "solo_agent"
    )  # _default beats agent_ref
    amap = {"code_env": "code_agent", "_default": "solo_agent"}
    assert keys(plan([r], agent_map=amap))[0][2] == "code_agent"  # task_source beats _default
    amap["math_agent"] = "solo_agent"
    amap["code_env"] = "code_agent"
    assert keys(plan([r], agent_map=amap))[0][2] == "solo_agent"  # agent_ref.name beats task_source
    assert keys(plan([row(task_source="code_env")]))[0][2] == "code_agent"  # resolution comes last


def test_agent_name_conflicting_with_agent_map_default_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"conflicts with agent_map\._default"):
        CollectionSettings(agent_name="a", agent_map={"_default": "b"})
    CollectionSettings(agent_name="a", agent_map={"_default": "a"})


def test_remapped_agent_ref_is_restamped_and_warned_about() -> None:
    r = row(agent_ref={"name": "math_agent", "type": "x"})
    same = plan([r])[0]
    assert same[F.AGENT_REF] == {"name": "math_agent", "type": "x"}  # unchanged: extra keys kept
    moved = plan([r], agent_map={"math_agent": "solo_agent"})[0]
    assert moved[F.AGENT_REF] == {"name": "solo_agent"}
    assert plan.warnings == [
        "agent_map overrode the agent_ref of rows that named an agent: math_agent -> solo_agent (1 rows)"
    ]


# --- task_source resolution ----------------------------------------------------------------


def test_task_source_resolution() -> None:
    out = plan([row(task_source=s) for s in ("solo_agent", "math_rs", "code_env", "math_env")])
    assert [r[F.AGENT_REF]["name"] for r in out] == [
        "solo_agent",
        "math_agent",
        "code_agent",
        "math_agent",
    ]
    assert all(r[F.TASK_SOURCE] for r in out)


def test_task_source_follows_the_dataset_pin() -> None:
    cfg = config(resources_servers__empty_rs={"datasets": [{"name": "d", "agent": "code_agent"}]})
    assert keys(plan([row(task_source="empty_rs")], cfg))[0][2] == "code_agent"


def test_unresolvable_task_sources_name_the_way_out() -> None:
    cfg = config(
        resources_servers__math_rs={
            "datasets": [{"name": "a", "agent": "math_agent"}, {"name": "b", "agent": "code_agent"}]
        },
        agents__code_agent__resources_server="empty_rs",
        agents__solo_agent__resources_server="empty_rs",
    )
    text = problems(
        [row(task_source="math_rs"), row(task_source="empty_rs"), row(task_source="math_envv")], cfg
    )
    assert (
        "<rows>:1, field 'task_source': task_source 'math_rs': its datasets pin conflicting agents (code_agent, math_agent)"
        in text
    )
    assert (
        "<rows>:2, field 'task_source': task_source 'empty_rs' (resources server) does not name one agent: agents code_agent, solo_agent are bound"
        in text
    )
    assert "+agent_map.empty_rs=<agent>" in text
    assert (
        "<rows>:3, field 'task_source': task_source 'math_envv' is not in the config (did you mean 'math_env'?)"
        in text
    )
    # agent_map is the disambiguator.
    amap = {"math_rs": "math_agent", "empty_rs": "solo_agent", "math_envv": "math_agent"}
    assert (
        len(
            plan(
                [
                    row(task_source="math_rs"),
                    row(task_source="empty_rs"),
                    row(task_source="math_envv"),
                ],
                cfg,
                agent_map=amap,
            )
        )
        == 3
    )


def test_resources_server_with_no_agent_bound() -> None:
    assert "no agent is bound to it" in problems([row(task_source="empty_rs")])


def test_unknown_agent_gets_a_did_you_mean_and_kind() -> None:
    text = problems([row(agent_ref=ref("math_agnet")), row(agent_ref=ref("math_env"))])
    assert (
        "agent 'math_agnet' (from agent_ref) is not in the config (did you mean 'math_agent'?)"
        in text
    )
    assert (
        "agent 'math_env' (from agent_ref) is not in the config; 'math_env' is an environment, not an agent"
        in text
    )


def test_no_agent_at_all() -> None:
    assert "<rows>:1, field 'agent_ref': no agent for this row" in problems([row()])
    assert keys(plan([row()], agent_name="solo_agent"))[0][2] == "solo_agent"


# --- fan_out and num_repeats -----------------------------------------------------------------


def test_fan_out_makes_one_copy_per_agent_with_successive_rollout_indices() -> None:
    out = plan(
        [row(agent_ref=ref("math_agent"))],
        fan_out={"math_agent": ["math_agent", "code_agent"]},
        num_repeats={"code_agent": 2, "_default": 1},
    )
    assert keys(out) == [(0, 0, "math_agent"), (0, 1, "code_agent"), (0, 2, "code_agent")]
    assert [r[F.ENVIRONMENT_SERVER] for r in out] == ["math_env", "code_env", "code_env"]


@pytest.mark.parametrize("lists", [{"a": []}, {"a": ["x", "x"]}])
def test_fan_out_empty_or_duplicated_lists_are_errors(lists: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match="fan_out"):
        CollectionSettings(fan_out=lists)


def test_num_repeats_lookup_order_target_then_basis_then_default() -> None:
    rows = [
        row("a", agent_ref=ref("math_agent")),
        row("b", task_source="code_env"),
        row("c", agent_ref=ref("solo_agent")),
    ]
    out = plan(rows, num_repeats={"math_agent": 3, "code_env": 2, "_default": 1, "typo_agent": 9})
    counts = {t: sum(1 for k in keys(out) if k[0] == t) for t in (0, 1, 2)}
    assert counts == {0: 3, 1: 2, 2: 1}
    assert plan.warnings == ["num_repeats names keys that no row used (possible typo?): typo_agent"]


def test_num_repeats_dict_without_a_match_is_an_error() -> None:
    text = problems([row(agent_ref=ref("math_agent"))], num_repeats={"code_agent": 2})
    assert (
        "num_repeats has no entry for math_agent and no '_default'; listed keys: code_agent" in text
    )


@pytest.mark.parametrize("value", [0, -1, {"a": 0}])
def test_num_repeats_below_one_is_an_error(value: Any) -> None:
    with pytest.raises(ValueError, match="num_repeats"):
        CollectionSettings(num_repeats=value)


def test_unused_num_repeats_key_warns_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    preprocess_examples([row(agent_ref=ref("math_agent"))], config(),
                        CollectionSettings(num_repeats={"_default": 1, "nobody": 2}))  # fmt: skip
    assert (
        "warning: num_repeats names keys that no row used (possible typo?): nobody"
        in capsys.readouterr().err
    )


# --- order -------------------------------------------------------------------------------


def test_duplicate_lines_share_a_task_and_keep_counting() -> None:
    a, b = row("A", agent_ref=ref("math_agent")), row("B", agent_ref=ref("math_agent"))
    out = plan([a, b, a], num_repeats=2)
    assert [k[:2] for k in keys(out)] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]


def test_interleave_repeats_is_a_stable_sort_by_rollout_index() -> None:
    a, b = row("A", agent_ref=ref("math_agent")), row("B", agent_ref=ref("code_agent"))
    out = plan([a, b], num_repeats=2, interleave_repeats=True)
    assert [k[:2] for k in keys(out)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_interleave_by_agent_round_robins() -> None:
    rows = [row(str(i), agent_ref=ref("math_agent")) for i in range(3)] + [
        row("c", agent_ref=ref("code_agent"))
    ]
    out = plan(rows, interleave_by_agent=True)
    assert [k[2] for k in keys(out)] == ["math_agent", "code_agent", "math_agent", "math_agent"]
    assert [k[0] for k in keys(out)] == [0, 3, 1, 2]


# --- task_ids, limit, task indices ------------------------------------------------------------


def test_task_ids_select_each_task_once_before_repetition() -> None:
    rows = [
        row("a", agent_ref=ref("math_agent"), task_id="t1"),
        row("b", agent_ref=ref("math_agent"), problem_id=7),
        row("c", agent_ref=ref("math_agent"), instance_id="i9"),
        row("d", agent_ref=ref("math_agent")),  # task index 3
        row("a2", agent_ref=ref("math_agent"), task_id="t1"),  # same id: not again
        row("e", agent_ref=ref("math_agent")),
    ]
    out = plan(rows, task_ids=["t1", 7, "i9", "3", "missing"], num_repeats=2)
    assert [k[:2] for k in keys(out)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    assert plan.warnings == ["task_ids matched no row: missing"]
    assert CollectionSettings(task_ids="a, b").task_ids == ["a", "b"]  # type: ignore[arg-type]


def test_limit_reads_only_the_first_lines(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(
        b"".join(orjson.dumps(row(str(i), agent_ref=ref("math_agent"))) + b"\n" for i in range(5))
        + b"not json\n"
    )
    out = list(plan_file(str(data), config(), CollectionSettings(limit=3), PlanContext("r")))
    assert [r[F.TASK_INDEX] for r in out] == [0, 1, 2]
    assert (
        len(list(plan_file(str(data), config(), CollectionSettings(limit=5), PlanContext("r"))))
        == 5
    )


def test_caller_stamped_task_indices_are_kept() -> None:
    out = plan(
        [
            row("x", agent_ref=ref("math_agent"), _ng_task_index=41),
            row("x", agent_ref=ref("math_agent"), _ng_task_index=41),
        ]
    )
    assert [k[:2] for k in keys(out)] == [(41, 0), (41, 1)]
    assert "_ng_task_index must be a non-negative integer" in problems(
        [row(agent_ref=ref("math_agent"), _ng_task_index=-1)]
    )
    assert "_ng_task_index must be a non-negative integer" in problems(
        [row(agent_ref=ref("math_agent"), _ng_task_index=True)]
    )


def test_file_identity_is_the_raw_line(tmp_path: Path) -> None:
    # Same content, different bytes: two tasks for a file (the raw line is the identity).
    data = tmp_path / "rows.jsonl"
    data.write_bytes(
        b'{"responses_create_params": {"input": "q"}, "agent_ref": {"name": "math_agent"}}\n'
        b'{"agent_ref": {"name": "math_agent"}, "responses_create_params": {"input": "q"}}\n'
        b'{"responses_create_params": {"input": "q"}, "agent_ref": {"name": "math_agent"}}\n'
    )
    out = list(plan_file(str(data), config(), CollectionSettings(), PlanContext("r")))
    assert [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in out] == [(0, 0), (1, 0), (0, 1)]


# --- rollout ids, environment stamps, pairing ---------------------------------------------------


def test_rollout_id_rules() -> None:
    m = ref("math_agent")
    text = problems(
        [
            row("1", agent_ref=m, _ng_rollout_id="ok.1"),
            row("2", agent_ref=m, _ng_rollout_id="ok.1"),
            row("3", agent_ref=m, _ng_rollout_id="_bad"),
            row("4", agent_ref=m, _ng_rollout_id="x-a2"),
            row("5", agent_ref=m, _ng_rollout_id=12),
        ]
    )
    assert "<rows>:2, field '_ng_rollout_id': rollout id 'ok.1' is already used on line 1" in text
    assert "<rows>:3, field '_ng_rollout_id': invalid rollout id '_bad'" in text
    assert "<rows>:4, field '_ng_rollout_id': rollout id 'x-a2' ends in -a<N>" in text
    assert "<rows>:5, field '_ng_rollout_id': invalid rollout id 12" in text
    assert "names one rollout, but the row plans 2" in problems(
        [row(agent_ref=m, _ng_rollout_id="one")], num_repeats=2
    )
    clash = [row("1", agent_ref=m), row("2", agent_ref=m, _ng_rollout_id="0-0")]
    assert "rollout id '0-0' is the id of another rollout (task 0, rollout 0)" in problems(clash)
    assert plan([row(agent_ref=m, _ng_rollout_id="0-0")])[0][F.ROLLOUT_ID] == "0-0"  # its own id


def test_environment_stamps() -> None:
    out = plan([row(agent_ref=ref(a)) for a in ("math_agent", "code_agent", "solo_agent")])
    assert [r[F.ENVIRONMENT_SERVER] for r in out] == ["math_env", "code_env", "solo_agent"]
    assert all(r[F.RUN_ID] == "r" and r[F.SHARD] == "0" for r in out)


def test_several_environment_servers_need_a_choice() -> None:
    cfg = config(
        agents__math_agent__environment=None,
        environments__math_env__agents=["math_agent"],
        environments__code_env__agents=["math_agent", "code_agent"],
    )
    text = problems([row(agent_ref=ref("math_agent"))], cfg)
    assert (
        "Agent 'math_agent' is fronted by several environment servers: ['code_env', 'math_env']. "
        "Rows that route by agent cannot choose between them. Set environment_routing_mode=legacy "
        "with environment_server_name, or route these rows by taskset"
    ) in text
    # The row's task_source picks one of them.
    out = plan([row(agent_ref=ref("math_agent"), task_source="math_env")], cfg)
    assert out[0][F.ENVIRONMENT_SERVER] == "math_env"


def test_missing_environment_server() -> None:
    text = problems(
        [row(agent_ref=ref("math_agent"))], config(agents__math_agent__environment="mth_env")
    )
    assert (
        "Agent 'math_agent' has no environment server, so collection cannot reach it: it names "
        "environment 'mth_env', which is not in the config (did you mean 'math_env'?)"
    ) in text


def test_allowed_agents_everywhere_the_row_meets(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(
        resources_servers__math_rs__allowed_agents=["judge"],
        environments__code_env__allowed_agents=["judge"],
        environments__code_env__datasets=[{"name": "ds", "allowed_agents": ["judge"]}],
    )
    text = problems([row(agent_ref=ref("math_agent")), row(task_source="code_env")], cfg)
    assert (
        "<rows>:1: agent 'math_agent' (type 'simple_agent') is not admitted by resources server 'math_rs', which agent 'math_agent' binds"
        in text
    )
    assert (
        "<rows>:2: agent 'code_agent' (type 'codex_agent') is not admitted by environment 'code_env' (the row's task_source)"
        in text
    )
    assert (
        "<rows>:2: agent 'code_agent' (type 'codex_agent') is not admitted by dataset 'ds' declared by 'code_env'"
        in text
    )
    assert len(plan([row(agent_ref=ref("math_agent"))], cfg, allow_unsupported_pairing=True)) == 1
    monkeypatch.setenv("NEMO_GYM_ALLOW_UNSUPPORTED_PAIRING", "1")
    assert len(plan([row(agent_ref=ref("math_agent")), row(task_source="code_env")], cfg)) == 2


# --- the Python API and problem reporting --------------------------------------------------------


def test_preprocess_never_mutates_and_returns_independent_copies() -> None:
    rows = [row(agent_ref=ref("math_agent"), meta={"tags": ["a"]})]
    before = copy.deepcopy(rows)
    out = plan(rows, num_repeats=2)
    assert rows == before
    out[0]["meta"]["tags"].append("b")
    assert out[1]["meta"]["tags"] == ["a"] and rows == before


def test_preprocess_accepts_a_nemo_gym_config_mapping() -> None:
    gym = {
        "math_agent": {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": 1}}},
        "policy_api_key": "sk-secret",
    }
    out = preprocess_examples([row(agent_ref=ref("math_agent"))], gym)
    assert out[0][F.ENVIRONMENT_SERVER] == "math_agent"


def test_every_problem_is_collected_with_every_line() -> None:
    rows: list[Any] = [row(agent_ref=ref("nobody")) for _ in range(5)] + ["text", {"x": 1}]
    rows[2] = row(agent_ref=ref("math_agent"))
    with pytest.raises(PlanningError) as info:
        preprocess_examples(rows, config(), CollectionSettings(agent_map={}))
    found = {(p.message.split(":")[0], p.line, p.lines) for p in info.value.problems}
    assert ("agent 'nobody' (from agent_ref) is not in the config", None, (1, 2, 4, 5)) in found
    assert ("a row must be a mapping, got str", 6, ()) in found
    assert "<rows>:1,2,4,5" in str(info.value)
