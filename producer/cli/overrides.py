"""NeMo Gym-style `+key=value` overrides on the command line (`+num_repeats=4`, `+agent_map.x=y`).

As in NeMo Gym's Hydra command line, `+key=value`, `++key=value` and `key=value` all set a key;
dots address nested keys and values are read as YAML (`4`, `true`, `[a, b]`, `{a: b}`). The
mapping they parse into is resolved into settings by `producer/config/overrides.py`.
"""

from __future__ import annotations

from typing import Any

import yaml

from schemas.errors import PlanningError, Problem


def parse_overrides(tokens: list[str]) -> dict[str, Any]:
    """Nested settings from `+a.b=value` tokens; values are read as YAML (`4`, `true`, `[a, b]`)."""
    out: dict[str, Any] = {}
    problems = []
    for token in tokens:
        body = token[2:] if token.startswith("++") else token.removeprefix("+")
        if "=" not in body or body.startswith("="):
            problems.append(Problem(f"expected +key=value, got {token!r}", field=token))
            continue
        key, raw = body.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        if not all(parts):
            problems.append(Problem(f"bad key in {token!r}", field=key))
            continue
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(f"{key!r} sets a key under a non-mapping value", field=key))
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise PlanningError(problems, header="invalid overrides")
    return out


def pop_flag_override(settings: dict[str, Any], key: str, flag: bool) -> bool:
    """`flag`, or the `+key=true|false` override taken out of `settings` (it is the command's,
    not a collection setting)."""
    if key not in settings:
        return flag
    value = settings.pop(key)
    if not isinstance(value, bool):
        raise PlanningError(
            [Problem(f"+{key} must be true or false, got {value!r}", field=key)],
            header="invalid overrides",
        )
    return flag or value
