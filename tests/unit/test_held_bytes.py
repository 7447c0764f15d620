"""Bytes a worker holds per rollout in flight are allocated at their own length.

orjson hands back its output in the buffer it grew while writing (a 62 KB line in a 128 KB
allocation, a 300-byte `/run` body in 4-8 KB). A worker holds a line from its reply's parsing
until the lander has written it, and a body for the whole `/run` call: thousands of each at a
time, so the slack was a worker's memory per rollout (`infra/jsonl.py`, `kept`).
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson

from infra import jsonl
from infra.http import StreamedReply
from schemas.messages import CallPolicy
from workers.rollout.agent_call import call_run
from workers.rollout.encoding import encode_records

SLACK = 64
"""Bytes an allocation may hold beyond its contents: the bytes object's header."""


def reply(kb: int) -> dict[str, Any]:
    """A `/run` result of about `kb` KB of reasoning items, as bench's agents pad theirs."""
    item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "step " * 180}]}
    return {
        "_ng_task_index": 3,
        "_ng_rollout_index": 0,
        "agent_ref": {"name": "a"},
        "response": {"output": [dict(item, id=f"rs_{i}") for i in range(kb)]},
        "reward": 1.0,
    }


@contextlib.contextmanager
def traced() -> Iterator[None]:
    tracemalloc.start(25)  # deep enough that two allocations at one line differ by caller
    try:
        yield
    finally:
        tracemalloc.stop()


def allocated(obj: object) -> int:
    """The size of the allocation holding `obj` (traced since `traced` began)."""
    where = tracemalloc.get_object_traceback(obj)
    assert where is not None
    sizes = [t.size for t in tracemalloc.take_snapshot().traces if t.traceback == where]
    assert sizes
    return max(sizes)


def test_orjson_output_may_hold_more_than_its_length_and_kept_holds_only_it() -> None:
    """The premise (where orjson keeps its buffer, `kept` is what lets it go) and the cure."""
    with traced():
        line = jsonl.dumps_line(reply(64))
        copy = jsonl.kept(line)
        held, own = allocated(line), allocated(copy)
    assert copy == line
    assert own <= len(copy) + SLACK
    assert held >= own  # orjson 3.13: about twice the length


def test_a_results_line_waiting_to_land_holds_only_its_length() -> None:
    with traced():
        encoded = encode_records(reply(64), [{"_ng_task_index": 3, "_ng_rollout_index": 0}])
        line = encoded.result_line
        assert line is not None
        assert allocated(line) <= len(line) + SLACK
        for failure in encoded.failure_lines:
            assert allocated(failure) <= len(failure) + SLACK
    assert orjson.loads(line)["response"] == reply(64)["response"]


class _Reply:
    status_code = 200

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.headers: dict[str, str] = {}

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        yield self.body


class _Client:
    """A `/run` client that measures the body it is handed while the call is under way."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, url: str, *, content: bytes, headers: dict[str, str]
    ) -> AsyncIterator[StreamedReply]:
        self.sent.append((allocated(content), len(content)))
        yield _Reply(orjson.dumps({"reward": 1.0}))


def test_a_run_body_held_for_its_call_holds_only_its_length() -> None:
    row = {"_ng_task_index": 3, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "q": "2+2?"}
    client = _Client()
    with traced():
        outcome = asyncio.run(call_run(client, "http://agent", row, CallPolicy()))
    assert outcome.result is not None
    [(held, length)] = client.sent
    assert held <= length + SLACK
