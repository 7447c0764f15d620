"""Loading the servers config (`--config`) into its normalised form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem


def _located(exc: ValidationError, source: str) -> PlanningError:
    problems = [
        Problem(message=err["msg"], file=source, field=".".join(str(p) for p in err["loc"]))
        for err in exc.errors()
    ]
    return PlanningError(problems, header=f"invalid servers config {source}")


def parse_servers_config(data: Any, source: str) -> ServersConfig:
    """Validate an already parsed config document."""
    if not isinstance(data, dict):
        raise PlanningError(
            [Problem("the config must be a mapping", file=source)], header="invalid servers config"
        )
    try:
        return ServersConfig.model_validate(data)
    except ValidationError as exc:
        raise _located(exc, source) from None


def load_servers_config(path: str | Path) -> ServersConfig:
    """Read a YAML servers config; every problem is reported with the file and field."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlanningError(
            [Problem(f"cannot read: {exc.strerror}", file=source)], header="invalid servers config"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise PlanningError(
            [Problem(f"not valid YAML: {exc}", file=source, line=line)],
            header="invalid servers config",
        ) from None
    return parse_servers_config(data, source)
