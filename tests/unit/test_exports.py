"""Every package says what it exports: an `__all__` of names that exist, in ruff's order (RUF022)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

import pytest

ROOTS = ("schemas", "infra", "producer", "workers")


def packages() -> list[str]:
    """Every package under the roots (modules are not imported: `__main__` would run)."""
    found = []
    for root in ROOTS:
        found.append(root)
        module = importlib.import_module(root)
        found += [
            info.name
            for info in pkgutil.walk_packages(module.__path__, prefix=f"{root}.")
            if info.ispkg
        ]
    return found


def ruff_order(name: str) -> tuple[int, list[tuple[int, int | str]]]:
    """isort-style, as RUF022 sorts `__all__`: CONSTANTS, then Classes, then the rest, naturally."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    natural = [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p]
    return kind, natural


def test_the_packages_are_found() -> None:
    assert {"producer.api", "producer.cli", "producer.shard", "workers.health"} <= set(packages())


@pytest.mark.parametrize("name", packages())
def test_package_exports_exist_and_are_sorted(name: str) -> None:
    package: ModuleType = importlib.import_module(name)
    exported = package.__dict__.get("__all__")
    assert isinstance(exported, list), f"{name} has no __all__ list"
    assert all(isinstance(n, str) for n in exported)
    missing = [n for n in exported if not hasattr(package, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    assert exported == sorted(exported, key=ruff_order), f"{name}.__all__ is not sorted"


def test_public_api_imports_from_where_the_readme_says() -> None:
    from producer import preprocess_examples, run_examples, run_outcomes
    from producer.api import Completions, Outcomes
    from producer.cli import main

    assert callable(preprocess_examples) and callable(run_examples) and callable(run_outcomes)
    assert Completions.__name__ == "Completions" and Outcomes.__name__ == "Outcomes"
    assert main.name == "main"
