"""The one poll of the finish step's result (`poll_finish`), over a stub Celery app."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from producer.shard.supervise import poll_finish, wait_for_finish


class StubResult:
    """Ready after `polls` polls; a poll listed in `failing` raises a Redis error."""

    def __init__(self, value: Any, polls: int, failing: frozenset[int] = frozenset()) -> None:
        self.value, self.polls, self.failing, self.seen = value, polls, failing, 0

    def ready(self) -> bool:
        self.seen += 1
        if self.seen in self.failing:
            raise redis.ConnectionError("gone for a moment")
        return self.seen > self.polls

    def get(self, propagate: bool, disable_sync_subtasks: bool) -> Any:
        assert (propagate, disable_sync_subtasks) == (False, False)
        return self.value


class StubApp:
    def __init__(self, result: StubResult) -> None:
        self.result = result

    def AsyncResult(self, task_id: str) -> StubResult:
        assert task_id == "finish-1"
        return self.result


def test_between_runs_after_each_unready_poll_and_errors_go_to_on_error() -> None:
    calls: list[str] = []
    errors: list[Exception] = []
    app: Any = StubApp(StubResult({"state": "completed"}, polls=3, failing=frozenset({2})))
    value = poll_finish(app, "finish-1", lambda: calls.append("between"), errors.append, poll_s=0)
    assert value == {"state": "completed"}
    assert calls == ["between"] * 3 and len(errors) == 1


def test_the_result_is_looked_at_more_often_than_the_progress_is_read() -> None:
    """A run returns as soon as its finish is seen, not at the next read of its progress."""
    calls: list[str] = []
    result = StubResult({"state": "completed"}, polls=3)
    app: Any = StubApp(result)
    value = poll_finish(app, "finish-1", lambda: calls.append("between"), poll_s=60, look_s=0)
    assert value == {"state": "completed"}
    assert result.seen == 4 and calls == ["between"]


def test_without_on_error_a_failed_poll_is_raised() -> None:
    app: Any = StubApp(StubResult({}, polls=3, failing=frozenset({1})))
    with pytest.raises(redis.ConnectionError):
        poll_finish(app, "finish-1", poll_s=0)


def test_wait_for_finish_returns_the_dict_or_says_the_step_failed() -> None:
    app: Any = StubApp(StubResult({"landed": 2}, polls=1))
    assert wait_for_finish(app, "finish-1", poll_s=0) == {"landed": 2}
    failed: Any = StubApp(StubResult(ValueError("boom"), polls=0))
    with pytest.raises(RuntimeError, match="the finish step failed"):
        wait_for_finish(failed, "finish-1", poll_s=0)
