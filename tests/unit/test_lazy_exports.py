"""Packages export their names lazily (`infra.lazy.exports`): the command line loads without the
run path, and every exported name is still there."""

from __future__ import annotations

import subprocess
import sys

import pytest

import producer
import producer.shard
from tests.helpers import ROOT


def test_the_command_line_loads_without_the_python_api_or_the_run_path() -> None:
    probe = (
        "import sys, producer.cli; "
        "print(sorted(m for m in ('producer.api', 'producer.shard.runner', 'celery') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("package", [producer, producer.shard])
def test_every_exported_name_resolves_to_its_module_s_object(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert names
    for name in names:
        value = getattr(package, name)
        assert value.__name__ == name and getattr(package, name) is value


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        producer.nothing_here  # noqa: B018
    from producer import run_examples
    from producer.api import run_examples as owned

    assert run_examples is owned
