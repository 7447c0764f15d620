"""Task selection (`task_ids`) and explicit rollout ids: the identity rules of docs/how-to/routing.md.

An explicit `_ng_rollout_id` replaces the derived `<task>-<rollout>` id, so it must name exactly
one rollout: it is refused on a row that plans several copies, when another row already uses it,
when it ends in the attempt suffix `-a<N>`, and when it equals another rollout's derived id.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from producer.planning.state import DigestTable, digest64
from schemas import fields as F

_ATTEMPT_SUFFIX = re.compile(r"-a\d+$")
_DERIVED_ID = re.compile(r"^(\d+)-(\d+)$")
_TASK_ID_FIELDS = ("task_id", "problem_id", "instance_id")

Report = Callable[[str, int], None]
"""Records a problem message for a 1-based line."""


def task_key(row: dict[str, Any], task: int) -> str:
    """A row's task id for `task_ids`: its task_id, problem_id or instance_id, else its task number."""
    for name in _TASK_ID_FIELDS:
        value = row.get(name)
        if isinstance(value, dict):  # a materialized task's {"taskset", "task_id"}
            value = value.get("task_id")
        if value is not None:
            return str(value)
    return str(task)


class TaskSelection:
    """`task_ids`: keep only the listed tasks, each once (the first line that carries it)."""

    def __init__(self, ids: Iterable[str | int]) -> None:
        self.wanted = {str(i) for i in ids}
        self.taken: set[str] = set()

    def keep(self, row: dict[str, Any], task: int) -> bool:
        key = task_key(row, task)
        if key not in self.wanted or key in self.taken:
            return False
        self.taken.add(key)
        return True

    def missing(self) -> list[str]:
        return sorted(self.wanted - self.taken)


class ExplicitRolloutIds:
    """Checks explicit rollout ids as rows arrive, and against every derived id at the end."""

    def __init__(self) -> None:
        self._first_line = DigestTable()
        self._derived_like: list[tuple[int, str, int, int]] = []

    def check(self, value: Any, line_no: int, copies: int, report: Report) -> bool:
        """Whether `value` may name the row on `line_no` that plans `copies` rollouts."""
        if not F.valid_rollout_id(value):
            report(
                f"invalid rollout id {value!r}: use letters, digits, '.', '_', '-', "
                "starting with a letter or digit",
                line_no,
            )
            return False
        if _ATTEMPT_SUFFIX.search(value):
            report(
                f"rollout id {value!r} ends in -a<N>, which marks re-dispatched attempts", line_no
            )
            return False
        ok = True
        if copies > 1:
            report(
                f"rollout id {value!r} names one rollout, but the row plans {copies} "
                "(num_repeats or fan_out); drop the id or plan the row once",
                line_no,
            )
            ok = False
        first = self._first_line.setdefault(digest64(value.encode()), line_no)
        if first != line_no:
            report(f"rollout id {value!r} is already used on line {first}", line_no)
            ok = False
        return ok

    def planned(self, value: str, line_no: int, task: int, rollout: int) -> None:
        """Remember an id shaped like a derived one, to compare with every rollout at the end."""
        if _DERIVED_ID.match(value):
            self._derived_like.append((line_no, value, task, rollout))

    def finish(self, rollouts_of: Callable[[int], int], report: Report) -> None:
        """Refuse ids equal to the derived id of another planned rollout."""
        for line_no, value, task, rollout in self._derived_like:
            other_task, other_rollout = (int(n) for n in value.split("-"))
            if (other_task, other_rollout) != (task, rollout) and other_rollout < rollouts_of(
                other_task
            ):
                report(
                    f"rollout id {value!r} is the id of another rollout (task {other_task}, "
                    f"rollout {other_rollout})",
                    line_no,
                )
