"""Summary facts (issue 40, acceptance 4): configuration facts as written from configs in both
formats (golden), the MLflow names fact, and gate facts bound to the inputs' SHA-256.

No value beyond names and flags reaches the facts: every config below holds secrets, and none
may appear in the facts or in the summary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from infra.store import RunDir
from producer.config.facts import config_facts, mlflow_names, run_facts
from producer.config.loading import load_servers_config, parse_servers_config
from producer.planning.materialize import new_manifest
from schemas.health import Limits
from schemas.records import InputSource
from schemas.settings import CollectionSettings
from tests.health_fixtures import (
    check_rollouts_file,
    healthy_trajectory,
    owed,
    read_summary,
    record,
    write_lines,
)
from workers.health import make_plan, run_local
from workers.health.sources import source_for

NEMO_GYM = """
policy_model:
  responses_api_models:
    openai_model:
      openai_api_key: sk-SECRET-policy
      host: 127.0.0.1
      port: 8000
math_agent:
  responses_api_agents:
    simple_agent:
      host: 127.0.0.1
      port: 9101
      skip_verification: true
      resources_server: {type: resources_servers, name: math_verifier}
      model_server: {type: responses_api_models, name: policy_model}
judge_agent:
  responses_api_agents:
    simple_agent:
      host: 127.0.0.1
      port: 9102
      skip_verification: ${oc.env:SKIP_VERIFICATION}
      resources_server: {type: resources_servers, name: "${oc.env:VERIFIER}"}
math_verifier:
  resources_servers:
    math_with_judge:
      judge_api_key: SECRET-judge
      domain: math
math_env:
  environment_servers:
    single_agent_turn:
      host: 127.0.0.1
      port: 9201
      agent_server: {type: responses_api_agents, name: math_agent}
mlflow_tracking_uri: https://user:SECRET-uri@mlflow.example
mlflow_experiment_name: math
mlflow_run_name: ${oc.env:RUN_NAME}
mlflow_tracking_token: SECRET-token
policy_api_key: SECRET-key
"""

OURS = """
agents:
  math_agent:
    url: http://127.0.0.1:9101
    type: simple_agent
    resources_server: math_verifier
    skip_verification: false
    headers: {Authorization: Bearer SECRET-bearer}
  code_agent:
    url: http://user:SECRET-pw@127.0.0.1:9102
    skip_verification: "yes"
environments:
  math_env:
    url: http://127.0.0.1:9201
    agents: [math_agent]
resources_servers:
  math_verifier:
    url: http://127.0.0.1:9301?api_key=SECRET-query
"""

GOLDEN_NEMO_GYM = {
    "route_failures_to_sidecar": None,
    "servers": {
        "math_agent": {"kind": "responses_api_agents", "implementation": "simple_agent",
                       "resources_server": "math_verifier", "skip_verification": True},
        # Interpolated values are unknown, never a default.
        "judge_agent": {"kind": "responses_api_agents", "implementation": "simple_agent",
                        "resources_server": None, "skip_verification": None},
        "math_verifier": {"kind": "resources_servers", "implementation": "math_with_judge",
                          "resources_server": None, "skip_verification": None},
        "math_env": {"kind": "environment_servers", "implementation": "single_agent_turn",
                     "resources_server": None, "skip_verification": None},
    },
    "mlflow_names": None,  # the run name is interpolated
}  # fmt: skip
GOLDEN_OURS = {
    "route_failures_to_sidecar": None,
    "servers": {
        "math_agent": {"kind": "responses_api_agents", "implementation": "simple_agent",
                       "resources_server": "math_verifier", "skip_verification": False},
        # A string is not a boolean: unknown.
        "code_agent": {"kind": "responses_api_agents", "implementation": None,
                       "resources_server": None, "skip_verification": None},
        "math_env": {"kind": "environment_servers", "implementation": None,
                     "resources_server": None, "skip_verification": None},
        "math_verifier": {"kind": "resources_servers", "implementation": None,
                          "resources_server": None, "skip_verification": None},
    },
    "mlflow_names": False,  # our format has no MLflow fields
}  # fmt: skip


def _no_secret(data: Any) -> None:
    assert b"SECRET" not in orjson.dumps(data)


@pytest.mark.parametrize(("text", "golden"), [(NEMO_GYM, GOLDEN_NEMO_GYM), (OURS, GOLDEN_OURS)])
def test_config_facts_as_written_in_both_formats(
    tmp_path: Path, text: str, golden: dict[str, Any]
) -> None:
    path = tmp_path / "servers.yaml"
    path.write_text(text)
    config = load_servers_config(path)
    facts = run_facts(config, CollectionSettings())
    assert facts.model_dump(mode="json") == golden
    _no_secret(facts.model_dump(mode="json"))
    # The same document handed over already parsed (the Python API) gives the same facts.
    parsed = parse_servers_config(yaml.safe_load(text), "<config>")
    assert run_facts(parsed, CollectionSettings()) == facts


def test_route_failures_to_sidecar_is_a_fact_only_when_the_run_was_given_it() -> None:
    config = parse_servers_config(yaml.safe_load(OURS), "<config>")
    given = CollectionSettings.model_validate({"route_failures_to_sidecar": False})
    assert run_facts(config, given).route_failures_to_sidecar is False
    assert run_facts(config, CollectionSettings()).route_failures_to_sidecar is None


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (("u", "e", "r"), True),
        (("u", "e", None), False),
        (("u", "", "r"), False),
        (("u", "e", "${oc.env:R}"), None),
        (("u", 3, "r"), None),
    ],
)
def test_the_mlflow_names_fact(values: tuple[Any, ...], expected: bool | None) -> None:
    names = ("mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name")
    data = {n: v for n, v in zip(names, values, strict=True) if v is not None}
    assert mlflow_names(data) is expected
    assert mlflow_names({}) is False


def test_the_summary_records_the_facts_and_binds_the_gate_to_the_inputs(tmp_path: Path) -> None:
    config = parse_servers_config(yaml.safe_load(NEMO_GYM), "<config>")
    settings = CollectionSettings.model_validate({"route_failures_to_sidecar": True})
    manifest = new_manifest(
        run_id="r", shard="0", input=InputSource(path="rows.jsonl", sha256="0" * 64),
        config=config, settings=settings, planned=4, materialized_sha256="0" * 64,
    )  # fmt: skip
    (tmp_path / "rollouts-0_manifest.json").write_bytes(manifest.model_dump_json().encode())
    write_lines(tmp_path / "rollouts-0_materialized_inputs.jsonl", owed(2, 2))
    write_lines(
        tmp_path / "rollouts-0.jsonl",
        [record(t, r, traj=healthy_trajectory()) for t, r in ((0, 0), (0, 1), (1, 0))],
    )
    # The failures sidecar's last line has no newline: its digest is of the bytes as they are.
    (tmp_path / "rollouts-0_failures.jsonl").write_bytes(
        orjson.dumps(
            {"_ng_task_index": 1, "_ng_rollout_index": 1, "_ng_failure_class": "agent_run_error"}
        )
    )
    rd = RunDir(str(tmp_path))
    sources = [source_for(rd, "rollouts-0.jsonl", "rollouts-0.jsonl")]

    for range_bytes in (1 << 40, 64):  # one job per file, and files split into byte ranges
        run_local(
            make_plan(
                rd.url,
                sources,
                limits=Limits(max_failed_rollouts=5),
                scratch=str(tmp_path / f"s{range_bytes}"),
                range_bytes=range_bytes,
            )
        )
        run = read_summary(tmp_path)["run"]
        assert run["config"] == {**GOLDEN_NEMO_GYM, "route_failures_to_sidecar": True}
        gate = run["gate"]
        assert (gate["healthy"], gate["unhealthy_rollouts"], gate["failed_rollouts"]) == (
            True,
            0,
            1,
        )
        assert gate["inputs"] == [
            {"source": "rollouts-0.jsonl", "kind": kind, "bytes": (tmp_path / name).stat().st_size,
             "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
            for kind, name in (
                ("results", "rollouts-0.jsonl"),
                ("failures", "rollouts-0_failures.jsonl"),
                ("materialized", "rollouts-0_materialized_inputs.jsonl"),
            )
        ]  # fmt: skip
        _no_secret(read_summary(tmp_path))


def test_a_folder_without_a_manifest_has_no_config_facts(tmp_path: Path) -> None:
    write_lines(tmp_path / "rollouts.jsonl", [record(0, 0)])
    check_rollouts_file(tmp_path)
    run = read_summary(tmp_path)["run"]
    assert run["config"] is None
    assert [i["kind"] for i in run["gate"]["inputs"]] == ["results"]


def test_facts_of_a_document_are_not_those_of_its_normalised_form() -> None:
    """Normalising drops an agent's skip_verification: the facts come from the document."""
    data = yaml.safe_load(NEMO_GYM)
    assert config_facts(data).servers["math_agent"].skip_verification is True
