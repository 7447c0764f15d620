"""A run's settings resolved once: base settings, flags and overrides into `CollectionSettings`.

`rollouts run`, `rollouts resume` and the Python API all call `resolve_settings`; the command
line's `+key=value` tokens are parsed into the overrides mapping by `producer/cli/overrides.py`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from schemas.errors import PlanningError, Problem, UsageError
from schemas.settings import CollectionSettings
from workers.health.registry import normalize_ignored


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
