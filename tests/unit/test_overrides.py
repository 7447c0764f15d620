"""NeMo Gym-style `+key=value` overrides and the settings they make."""

from __future__ import annotations

import pytest

from producer.cli.overrides import parse_overrides
from producer.config.overrides import validate_settings
from schemas.errors import PlanningError


def test_override_forms() -> None:
    values = parse_overrides(
        [
            "+num_repeats=4",
            "+agent_map.math_env=math_agent",
            "++agent_map._default=count_agent",
            "interleave_by_agent=true",
            "+task_ids=[a, 3]",
            "+fan_out={math_agent: [math_agent, count_agent]}",
            "+limit=",
        ]
    )
    assert values == {
        "num_repeats": 4,
        "agent_map": {"math_env": "math_agent", "_default": "count_agent"},
        "interleave_by_agent": True,
        "task_ids": ["a", 3],
        "fan_out": {"math_agent": ["math_agent", "count_agent"]},
        "limit": None,
    }
    settings = validate_settings(values)
    assert settings.agent_map["_default"] == "count_agent" and settings.limit is None


def test_num_repeats_as_a_dict_by_dotted_keys() -> None:
    values = parse_overrides(["+num_repeats.math_agent=3", "+num_repeats._default=1"])
    assert validate_settings(values).num_repeats == {"math_agent": 3, "_default": 1}


def test_bad_overrides_are_all_reported() -> None:
    with pytest.raises(PlanningError) as info:
        parse_overrides(["+num_repeats", "+a..b=1", "+x=1", "+x.y=2"])
    assert len(info.value.problems) == 3


def test_unknown_and_invalid_settings_are_reported_together() -> None:
    with pytest.raises(PlanningError) as info:
        validate_settings({"num_repeat": 2, "limit": -1, "fan_out": {"a": []}})
    text = str(info.value)
    assert "field 'num_repeat': unknown setting (did you mean 'num_repeats'?)" in text
    assert "field 'limit'" in text
    assert "fan_out['a'] is an empty list" in text
    assert validate_settings({"max_resident_rollout_tasks": 5}).max_resident_tasks == 5
