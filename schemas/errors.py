"""The error tree of rollouts.

    RolloutsError
    ├── UsageError            bad usage, config or input; exit code 2, nothing dispatched
    │   └── PlanningError     every problem planning found, each with its file and line
    ├── StorageError          a run directory cannot be read or written as expected
    │   ├── ShardFencedError  another writer opened the shard since this one did
    │   └── RunExistsError    a fresh run would overwrite an earlier run's shard
    ├── TransientError        worth retrying (a lost Redis connection, a busy lock)
    ├── RunFailedError        the run ended and must be reported as failed; exit code 1
    │   └── RunPartialError   it saved a partial result that a resume can complete; exit code 75
    └── RolloutFailedError    a rollout of `run_examples` failed; raised by its awaitable

A failed rollout is never an exception that leaves a worker: it is a failure row (data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RolloutsError(Exception):
    """Raised for every error this package reports on purpose."""


class UsageError(RolloutsError):
    """Raised when the command line, the config or the input is wrong; nothing was dispatched."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input, located as precisely as planning knows it."""

    message: str
    file: str | None = None
    line: int | None = None
    field: str | None = None
    lines: tuple[int, ...] = ()
    """Every 1-based line the problem applies to, ascending, when it applies to several."""

    def render(self) -> str:
        where = []
        if self.file is not None:
            if self.lines:
                where.append(f"{self.file}:{render_lines(self.lines)}")
            else:
                where.append(self.file if self.line is None else f"{self.file}:{self.line}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


MAX_RENDERED_RANGES = 200


def render_lines(lines: tuple[int, ...]) -> str:
    """Ascending line numbers as `3,5,7-12`, with runs of three or more collapsed into a range."""
    parts: list[str] = []
    i = 0
    while i < len(lines) and len(parts) < MAX_RENDERED_RANGES:
        j = i
        while j + 1 < len(lines) and lines[j + 1] == lines[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{lines[i]}-{lines[j]}")
        else:
            parts.extend(str(n) for n in lines[i : j + 1])
        i = j + 1
    text = ",".join(parts)
    if i < len(lines):
        text += f" (and {len(lines) - i} more lines)"
    return text


class PlanningError(UsageError):
    """Raised when planning finds problems; it carries all of them, not just the first."""

    def __init__(self, problems: list[Problem], header: str = "planning failed") -> None:
        self.problems = problems
        self.header = header
        lines = [f"{header} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p.render()}" for p in problems]
        super().__init__("\n".join(lines))


class StorageError(RolloutsError):
    """Raised when a run directory cannot be read or written as the layout requires."""


class ShardFencedError(StorageError):
    """Raised to a writer whose shard was opened by another writer since it opened it."""


class RunExistsError(StorageError, UsageError):
    """Raised when a fresh run would write into a folder holding an earlier run of the shard."""


class TransientError(RolloutsError):
    """Raised for conditions that are expected to clear; the caller retries."""


class RunFailedError(RolloutsError):
    """Raised when a run ends failed or rejected; the CLI exits 1 with this message."""

    exit_code = 1


EXIT_PARTIAL = 75
"""`EX_TEMPFAIL`: the exit code of a run that saved a partial result a resume can complete, so a
scheduler requeues it (Slurm: `--requeue`, or an `afternotok` chain)."""


class RunPartialError(RunFailedError):
    """Raised when a run stopped with a partial result saved that a resume can complete (drained
    by its dispatch budget or `cancel --drain`, stopped by SIGTERM, or a strict run still short of
    rollouts it can run); the CLI exits 75 with this message."""

    exit_code = EXIT_PARTIAL


class RolloutFailedError(RolloutsError):
    """Raised by a `run_examples` awaitable whose rollout failed and was not routed to the sidecar.

    `failure` is the failure row (or None when the worker itself could not finish the rollout);
    `row` is the caller's row.
    """

    def __init__(
        self, message: str, row: dict[str, Any], failure: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.row = row
        self.failure = failure
