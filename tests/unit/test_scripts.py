"""The Lua scripts name their KEYS and ARGV once, at the top, and use the names after."""

from __future__ import annotations

import re

import pytest

from infra import scripts

SCRIPTS = {name: value for name, value in vars(scripts).items() if name.endswith("_LUA")}


def test_every_script_is_here() -> None:
    assert sorted(SCRIPTS) == [
        "ACQUIRE_READING_LUA",
        "BACK_OFF_LUA",
        "BEGIN_LUA",
        "END_LUA",
        "EXTEND_LUA",
        "GIVE_BACK_LUA",
        "LANDED_LUA",
        "RELEASE_LUA",
        "RENEW_LUA",
        "RENEW_ROLLOUTS_LUA",
        "RUNNING_LUA",
        "SETTLE_LUA",
        "TAKE_LEASE_LUA",
    ]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_keys_and_argv_are_indexed_only_where_they_are_named(name: str) -> None:
    lines = [line.strip() for line in SCRIPTS[name].splitlines()]
    assert lines[1].startswith("--"), "a script opens with a comment saying what it does"
    code = [line for line in lines if not line.startswith("--")]
    indexed = [line for line in code if re.search(r"\b(KEYS|ARGV)\[", line)]
    assert indexed, "a script takes its KEYS and ARGV by name"
    assert all(line.startswith("local ") for line in indexed), indexed
