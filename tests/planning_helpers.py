"""Planning as the unit tests drive it: `preprocess_examples` of rows written in one line, against
a config of the test's, its warnings kept; and the config the routing rules are read against."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from producer.planning.planner import preprocess_examples
from schemas.config import ServersConfig
from schemas.errors import PlanningError
from schemas.settings import CollectionSettings

CONFIG: dict[str, Any] = {
    "agents": {
        "math_agent": {"url": "http://m", "type": "simple_agent", "environment": "math_env",
                       "resources_server": "math_rs"},
        "code_agent": {"url": "http://c", "type": "codex_agent", "environment": "code_env"},
        "solo_agent": {"url": "http://s", "type": "simple_agent"},
    },
    "environments": {
        "math_env": {"url": "http://me", "resources_server": "math_rs"},
        "code_env": {"url": "http://ce"},
    },
    "resources_servers": {"math_rs": {}, "empty_rs": {}},
}  # fmt: skip
"""Three agents (one bound to a resources server, one of another harness, one alone), two
environments, two resources servers: what the routing rules are read against."""


def config(**changes: Any) -> ServersConfig:
    """`CONFIG` with `changes`, each a path of keys joined by `__` and its new value."""
    data = copy.deepcopy(CONFIG)
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return ServersConfig.model_validate(data)


def row(text: str = "q", **fields: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": text}, **fields}


def ref(name: str) -> dict[str, str]:
    return {"name": name}


class Planner:
    """`preprocess_examples` of rows as run `r`, against `default()` unless given a config; the
    last plan's warnings in `warnings`."""

    def __init__(self, default: Callable[[], ServersConfig]) -> None:
        self.default = default
        self.warnings: list[str] = []

    def __call__(
        self, rows: list[Any], cfg: ServersConfig | None = None, **settings: Any
    ) -> list[dict[str, Any]]:
        warnings: list[str] = []
        out = preprocess_examples(
            rows,
            cfg or self.default(),
            CollectionSettings(**settings),
            run_id="r",
            on_warning=warnings.append,
        )
        self.warnings = warnings
        return out

    def problems(self, rows: list[Any], cfg: ServersConfig | None = None, **settings: Any) -> str:
        """The planning error's text (the plan must fail)."""
        with pytest.raises(PlanningError) as info:
            self(rows, cfg, **settings)
        return str(info.value)
