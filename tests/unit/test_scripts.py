"""The Lua scripts name their KEYS and ARGV once, at the top, and use the names after."""

from __future__ import annotations

import re

import pytest

from infra import generation, scripts
from infra.slots import slot_agent, slot_holder, slot_member
from workers.shard.leases import lease_member

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
        "REFILL_DONE_LUA",
        "REFILL_TAKE_LUA",
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


def _generation_fields(lua: str) -> set[str]:
    """The generation hash's fields a script names as literals."""
    fields: set[str] = set()
    for call in re.findall(r"redis\.call\('H\w+', generation_key((?:, '\w+')+)", lua):
        fields.update(re.findall(r"'(\w+)'", call))
    # BEGIN_LUA counts into the generation through its local `count(field)`.
    fields.update(re.findall(r"\bcount\('(\w+)'\)", lua))
    return fields


@pytest.mark.parametrize("name", ["BEGIN_LUA", "END_LUA", "SETTLE_LUA"])
def test_the_generation_fields_of_a_script_are_the_owners(name: str) -> None:
    lua = SCRIPTS[name]
    named = {
        generation.TOKEN, generation.ENQUEUED, generation.FINISH, generation.COUNTED,
        *generation.COUNTERS,
    }  # fmt: skip
    found = _generation_fields(lua)
    assert found, "the script reads or counts the generation hash"
    assert found <= named, found - named
    assert "infra/generation.py" in lua, "the script names the layout's owner"


def test_the_scripts_read_every_generation_field_the_producer_writes_for_them() -> None:
    read = set().union(*(_generation_fields(SCRIPTS[n]) for n in ("BEGIN_LUA", "SETTLE_LUA")))
    assert {generation.TOKEN, generation.ENQUEUED, generation.FINISH, generation.COUNTED} <= read


def test_the_rollout_lease_member_splits_where_its_owner_joins() -> None:
    lua = SCRIPTS["RENEW_ROLLOUTS_LUA"]
    assert "workers/shard/leases.py" in lua, "the script names the layout's owner"
    (separator,) = re.findall(r"string\.find\(member, '(.)', 1, true\)", lua)
    assert lease_member("sid", "3:0") == f"sid{separator}3:0"


def test_a_slot_member_names_its_holder_and_agent() -> None:
    member = slot_member("host:42", 7, "agent-a", "3:0")
    assert (slot_holder(member), slot_agent(member)) == ("host:42", "agent-a")
    assert slot_agent("no-agent") == ""
