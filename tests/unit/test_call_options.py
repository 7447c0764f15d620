"""`run_examples` and `run_outcomes` take one set of keyword options (`CallOptions`), and refuse
any other name as a Python function would, before anything is planned or sent."""

from __future__ import annotations

import pytest

from producer import run_examples, run_outcomes
from producer.api import CallOptions

CONFIG = {"agents": {"a": {"url": "http://127.0.0.1:9"}}}


def test_an_unknown_option_is_refused_as_python_would() -> None:
    with pytest.raises(
        TypeError, match=r"run_examples\(\) got an unexpected keyword argument 'max_tasks'"
    ):
        run_examples([], CONFIG, max_tasks=3)  # type: ignore[call-arg]


def test_run_outcomes_does_not_take_the_options_of_run_examples_alone() -> None:
    for name in ("route_failures_to_sidecar", "record_unrouted_failures"):
        with pytest.raises(
            TypeError, match=f"run_outcomes\\(\\) got an unexpected keyword argument '{name}'"
        ):
            run_outcomes([], CONFIG, **{name: True})  # type: ignore[arg-type]


def test_every_option_is_documented() -> None:
    import ast
    import inspect
    import itertools

    source = inspect.getsource(CallOptions)
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    documented = {
        ast.unparse(node.target)
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
    }
    assert documented == set(CallOptions.__optional_keys__)
