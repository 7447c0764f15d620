"""A rollout task's return value, rendered by Celery's tracer in one `repr` call.

Celery's tracer renders every task's return value with its streaming `saferepr`, for the worker's
log line and the `task-succeeded` event Flower shows, whether or not anything reads them. Over a
dict it walks item by item in Python: about 100 µs for a landed rollout's summary with its health
verdict on two shared cores, some 3-4% of a rollout's CPU at `inflight-4k` (py-spy, holding the
GIL). `saferepr` renders an object that is not a dict, list, tuple, set, string or number with
`repr`, so a summary wrapped in `Shown` costs 1-2 µs and reads the same in Flower. Only a flat
enough summary that fits the task's `resultrepr_maxsize` is wrapped: `saferepr` cuts a longer
one value by value and elides what is nested deeper than three levels (a drained row), which
`repr` would not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

NESTED = "row"
"""The summary field that holds a whole row (a drained rollout's): left to `saferepr`."""


class Shown(Mapping[str, Any]):
    """A task's summary dict, read-only: equal to it, stored as it by kombu's JSON encoder (which
    asks `__json__`), and rendered by `repr` as the dict is."""

    __slots__ = ("_summary", "_text")

    def __init__(self, summary: Mapping[str, Any], text: str) -> None:
        self._summary = summary
        self._text = text

    def __getitem__(self, key: str) -> Any:
        return self._summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._summary)

    def __len__(self) -> int:
        return len(self._summary)

    def __repr__(self) -> str:
        return self._text

    def __json__(self) -> Mapping[str, Any]:
        return self._summary


def shown(summary: Mapping[str, Any], limit: int) -> Mapping[str, Any]:
    """`summary` as a task returns it: wrapped in `Shown` when `saferepr` with `limit` (the
    task's `resultrepr_maxsize`) would render it as `repr` does, else as it is."""
    if NESTED in summary:
        return summary
    text = repr(summary)
    return Shown(summary, text) if len(text) <= limit else summary
