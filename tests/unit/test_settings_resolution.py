"""One resolution of collection settings for `run`, `resume` and the Python API."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from producer import run_examples
from producer.cli.overrides import parse_overrides
from producer.config.overrides import resolve_settings
from producer.shard.resume import resume_settings
from schemas.errors import PlanningError
from schemas.records import InputSource, Manifest
from schemas.settings import CollectionSettings

CONFIG: dict[str, Any] = {
    "agents": {"solo_agent": {"url": "http://s", "type": "simple_agent"}},
}
ROWS = [{"responses_create_params": {"input": "q"}, "agent_ref": {"name": "solo_agent"}}]
UNKNOWN_CHECK = "field 'health_check_ignored_checks': unknown health check id(s): no_such_check"


def manifest(**settings: Any) -> Manifest:
    return Manifest(
        run_id="run-x", shard="0", created_at="now", input=InputSource(path="in", sha256="0"),
        config=CONFIG, settings=CollectionSettings(**settings).model_dump(mode="json"),
        planned=1, materialized_sha256="0",
    )  # fmt: skip


def test_base_then_overrides() -> None:
    base = CollectionSettings(num_repeats=3, rollout_timeout_s=5)
    settings = resolve_settings(base, {"rollout_timeout_s": 7})
    assert (settings.num_repeats, settings.rollout_timeout_s) == (3, 7)
    assert resolve_settings(None, {"max_resident_rollout_tasks": 4}).max_resident_tasks == 4


def test_an_unknown_health_check_id_is_refused_by_the_cli_path() -> None:
    overrides = parse_overrides(["+health_check_ignored_checks=[no_such_check]"])
    with pytest.raises(PlanningError) as info:
        resolve_settings(None, overrides)
    assert UNKNOWN_CHECK in str(info.value)
    assert info.value.header == "invalid collection settings"


@pytest.mark.parametrize("via", ["settings", "base"])
def test_run_examples_refuses_an_unknown_health_check_id_as_the_cli_does(via: str) -> None:
    """Refused before anything is sent (no broker is needed to see it)."""
    ignored = ["no_such_check"]
    base: Any = (
        {"health_check_ignored_checks": ignored}
        if via == "settings"
        else CollectionSettings.model_construct(health_check_ignored_checks=ignored)
    )
    with pytest.raises(PlanningError) as info:
        run_examples(ROWS, CONFIG, settings=base, broker_url="memory://")
    assert UNKNOWN_CHECK in str(info.value)
    assert info.value.header == "invalid collection settings"


def test_run_examples_reports_unknown_settings_as_the_cli_does() -> None:
    with pytest.raises(PlanningError) as info:
        run_examples(ROWS, CONFIG, settings={"num_repeat": 2}, broker_url="memory://")
    assert "field 'num_repeat': unknown setting (did you mean 'num_repeats'?)" in str(info.value)


def test_resume_refuses_an_unknown_health_check_id() -> None:
    with pytest.raises(PlanningError) as info:
        resume_settings(manifest(), {"health_check_ignored_checks": ["no_such_check"]}, Console())
    assert UNKNOWN_CHECK in str(info.value)
    settings, changed = resume_settings(
        manifest(num_repeats=2), {"rollout_timeout_s": 9}, Console()
    )
    assert (settings.num_repeats, settings.rollout_timeout_s, changed) == (
        2,
        9,
        {"rollout_timeout_s": 9},
    )
