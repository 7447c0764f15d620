"""A rollout task's summary as Celery's tracer renders it (`workers/task_results.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.utils.saferepr import saferepr
from kombu.utils import json as kombu_json

from workers.task_results import Shown, shown

SUMMARIES: list[dict[str, Any]] = [
    {"rollout": "12-3", "outcome": "landed", "requests": 1,
     "health": {"verdict": "healthy", "findings": {}}},
    {"rollout": "12-3", "outcome": "landed", "requests": 2,
     "health": {"verdict": "unhealthy", "findings": {"empty_output": 1, "truncated": 2}}},
    {"rollout": None, "outcome": "error", "error": "ConnectionError: refused"},
    {"rollout": 7, "outcome": "landed"},
    # Left to saferepr: a drained row (nested past three levels), a summary past the limit.
    {"rollout": "0-0", "outcome": "drained",
     "row": {"task_index": 0, "responses_create_params": {"input": [{"content": [{"a": 1}]}]}}},
    {"rollout": "1-0", "outcome": "error", "error": "refused " * 400},
]  # fmt: skip


def traced(summary: Mapping[str, Any]) -> tuple[Any, str]:
    """What Celery's tracer (the worker's, `build_tracer`) returns and renders for a task that
    returns `shown(summary)`."""
    app = Celery("shown", set_as_current=False)

    def run(self: Any) -> Mapping[str, Any]:
        return shown(summary, self.resultrepr_maxsize)

    task = app.task(name="shown.summary", shared=False, bind=True)(run)

    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=True)
    retval, info, _, text = tracer(uuid.uuid4().hex, (), {}, {"ignore_result": True})
    assert info is None
    return retval, text


@pytest.mark.parametrize("summary", SUMMARIES)
def test_the_tracer_renders_it_as_it_renders_the_dict(summary: dict[str, Any]) -> None:
    retval, text = traced(summary)
    assert text == saferepr(summary, 1024)
    assert retval == summary and dict(retval) == summary


def test_the_common_summaries_are_wrapped_and_the_rest_left_as_they_are() -> None:
    wrapped = [isinstance(shown(s, 1024), Shown) for s in SUMMARIES]
    assert wrapped == [True, True, True, True, False, False]


def test_it_is_stored_and_read_back_as_its_dict() -> None:
    summary = SUMMARIES[1]
    value = shown(summary, 1024)
    assert isinstance(value, Shown)
    assert kombu_json.loads(kombu_json.dumps({"result": value})) == {"result": summary}
