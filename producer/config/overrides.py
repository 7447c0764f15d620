"""NeMo Gym-style `+key=value` overrides (`+num_repeats=4`, `+agent_map.math_env=math_agent`).

As in NeMo Gym's Hydra command line, `+key=value`, `++key=value` and `key=value` all set a key;
dots address nested keys and values are read as YAML (`4`, `true`, `[a, b]`, `{a: b}`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.errors import PlanningError, Problem, UsageError
from schemas.settings import CollectionSettings
from workers.health.registry import normalize_ignored


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


def resolve_settings(
    base: CollectionSettings | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> CollectionSettings:
    """The collection settings of `run`, `resume` and the Python API: `base` (a run's recorded
    settings, the API's `settings=`) with flags and `+key=value` overrides over it, validated.

    Every problem is raised at once (PlanningError): unknown keys with a guess, and unknown
    health check ids in `health_check_ignored_checks`.
    """
    values = base.model_dump() if isinstance(base, CollectionSettings) else dict(base or {})
    settings = validate_settings({**values, **(overrides or {})})
    try:
        normalize_ignored(settings.health_check_ignored_checks)
    except UsageError as exc:
        raise PlanningError(
            [Problem(str(exc), field="health_check_ignored_checks")],
            header="invalid collection settings",
        ) from None
    return settings


def validate_settings(values: dict[str, Any]) -> CollectionSettings:
    """Collection settings from flags and overrides; every problem at once, unknown keys with a guess."""
    try:
        return CollectionSettings.model_validate(values)
    except ValidationError as exc:
        known = [*CollectionSettings.model_fields, "max_resident_rollout_tasks"]
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(err["loc"][0]), known, n=1)
                message = "unknown setting" + (f" (did you mean {close[0]!r}?)" if close else "")
            elif message.startswith("Value error, "):
                message = message[len("Value error, ") :]
            problems.append(Problem(message, field=where or None))
        raise PlanningError(problems, header="invalid collection settings") from None
