"""Collecting planning problems: one entry per distinct problem, naming every line it hits.

A million rows that name the same unknown agent make one problem with a million line numbers,
not a million problems; both memory and the error message stay readable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.errors import PlanningError, Problem

MAX_DISTINCT = 1000
MAX_LINES_PER_PROBLEM = 100_000


@dataclass
class _Group:
    first: int
    lines: list[int] = field(default_factory=list)
    more: int = 0


@dataclass
class ProblemLog:
    """Problems found so far, grouped by (file, message, field)."""

    source: str
    rows: int = 0
    """Rows (lines) with at least one problem."""
    failed: bool = False
    """Whether any problem was recorded (an attribute: the planner reads it once per row)."""
    _groups: dict[tuple[str | None, str, str | None], _Group] = field(default_factory=dict)
    _dropped: int = 0
    _last_row: int | None = None

    def __bool__(self) -> bool:
        return bool(self._groups) or self._dropped > 0

    def add(
        self, message: str, line: int | None, field_: str | None = None, file: str | None = None
    ) -> None:
        """Record `message` for `line` (None: not about one line)."""
        self.failed = True
        if line is not None and line != self._last_row:
            self._last_row = line
            self.rows += 1
        key = (file or self.source, message, field_)
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= MAX_DISTINCT:
                self._dropped += 1
                return
            group = self._groups[key] = _Group(first=line if line is not None else 0)
        if line is None or (group.lines and group.lines[-1] == line):
            return
        if len(group.lines) < MAX_LINES_PER_PROBLEM:
            group.lines.append(line)
        else:
            group.more += 1

    def add_problem(self, problem: Problem) -> None:
        """Record a problem located elsewhere than in the rows (the config's), as it is."""
        self.failed = True
        key = (problem.file, problem.message, problem.field)
        if key not in self._groups:
            self._groups[key] = _Group(first=0, lines=[problem.line] if problem.line else [])

    def problems(self) -> list[Problem]:
        out = []
        for (file, message, field_), group in sorted(
            self._groups.items(), key=lambda item: item[1].first
        ):
            text = message if not group.more else f"{message} (and {group.more} more lines)"
            if len(group.lines) == 1:
                out.append(Problem(text, file=file, line=group.lines[0], field=field_))
            else:
                out.append(Problem(text, file=file, field=field_, lines=tuple(group.lines)))
        if self._dropped:
            out.append(Problem(f"... and {self._dropped} more problems", file=self.source))
        return out

    def error(self) -> PlanningError:
        rows = f" on {self.rows} row{'s' if self.rows != 1 else ''}" if self.rows else ""
        return PlanningError(self.problems(), header=f"cannot plan {self.source}{rows}")
