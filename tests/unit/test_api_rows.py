"""The rows of a `run_examples` call: copies the call owns, a recorded call's prefixed rollout ids,
and `task_source` resolution deferred from `preprocess_examples` without a config."""

from __future__ import annotations

import copy

import pytest

from producer.api.rows import Stamp, prepare_rows
from producer.planning import preprocess_examples
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError
from schemas.settings import CollectionSettings

CONFIG = ServersConfig.model_validate(
    {
        "agents": {"math_agent": {"url": "http://a", "environment": "math_env"}},
        "environments": {"math_env": {"url": "http://e"}},
    }
)
PARAMS = {"input": [{"role": "user", "content": "1+1"}]}


def row(i: int, **fields: object) -> dict[str, object]:
    return {"responses_create_params": PARAMS, "question": i, **fields}


def test_without_a_config_task_sources_are_left_for_run_examples_to_resolve() -> None:
    raw = [row(0, task_source="math_env"), row(1, agent_ref={"name": "math_agent"})]
    given = copy.deepcopy(raw)
    planned = preprocess_examples(raw, settings=CollectionSettings(num_repeats=2))
    assert raw == given  # not mutated
    assert [(r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r in planned] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    deferred, named = planned[0], planned[2]
    assert F.AGENT_REF not in deferred and deferred[F.TASK_SOURCE] == "math_env"
    assert F.ENVIRONMENT_SERVER not in deferred
    assert named[F.AGENT_REF] == {"name": "math_agent"}
    # run_examples resolves the task_source against its config, and checks every agent.
    sent = prepare_rows(planned, CONFIG, CollectionSettings(), Stamp())
    assert sent.agents == ["math_agent"] * 4
    assert sent.sent[0][F.AGENT_REF] == {"name": "math_agent"}
    with pytest.raises(PlanningError, match="task_source 'nowhere' is not in the config"):
        prepare_rows(preprocess_examples([row(0, task_source="nowhere")]), CONFIG,
                     CollectionSettings(), Stamp())  # fmt: skip


def test_without_a_config_a_row_with_neither_agent_nor_source_is_refused() -> None:
    with pytest.raises(PlanningError, match="no agent for this row"):
        preprocess_examples([row(0)])
    assert F.AGENT_REF in preprocess_examples([row(0)], settings=CollectionSettings(
        agent_name="math_agent"))[0]  # fmt: skip


def test_the_rows_sent_are_copies_the_caller_can_change_without_effect() -> None:
    given = [row(0, agent_ref={"name": "math_agent"})]
    sent = prepare_rows(given, CONFIG, CollectionSettings(), Stamp()).sent
    assert sent == given and sent[0] is not given[0]
    given[0]["question"] = "changed"
    given[0]["responses_create_params"]["input"].append({"role": "user", "content": "more"})  # type: ignore[index]
    assert sent[0]["question"] == 0 and len(sent[0]["responses_create_params"]["input"]) == 1


def test_a_recorded_call_prefixes_its_rollout_ids_with_the_run_id() -> None:
    planned = preprocess_examples([row(0), row(1, _ng_rollout_id="q7")], CONFIG,
                                  CollectionSettings(agent_name="math_agent"))  # fmt: skip
    stamp = Stamp(run_id="run-a", shard="s")
    sent = prepare_rows(planned, CONFIG, CollectionSettings(), stamp).sent
    assert [F.rollout_id(r) for r in sent] == ["run-a-0-0", "run-a-q7"]
    again = prepare_rows(sent, CONFIG, CollectionSettings(), stamp).sent  # read back: kept
    assert [F.rollout_id(r) for r in again] == ["run-a-0-0", "run-a-q7"]
    unrecorded = prepare_rows(planned, CONFIG, CollectionSettings(), Stamp(run_id="run-a")).sent
    assert [F.rollout_id(r) for r in unrecorded] == ["0-0", "q7"]
