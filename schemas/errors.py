"""The error tree of rollouts.

    RolloutsError
    ├── UsageError            bad usage, config or input; exit code 2, nothing dispatched
    │   └── PlanningError     every problem planning found, each with its file and line
    ├── StorageError          a run directory cannot be read or written as expected
    │   ├── ShardFencedError  another writer opened the shard since this one did
    │   └── RunExistsError    a fresh run would overwrite an earlier run's shard
    ├── TransientError        worth retrying (a lost Redis connection, a busy lock)
    └── RunFailedError        the run ended and must be reported as failed; exit code 1

A failed rollout is never an exception that leaves a worker: it is a failure row (data).
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def render(self) -> str:
        where = []
        if self.file is not None:
            where.append(self.file if self.line is None else f"{self.file}:{self.line}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


class PlanningError(UsageError):
    """Raised when planning finds problems; it carries all of them, not just the first."""

    def __init__(self, problems: list[Problem], header: str = "planning failed") -> None:
        self.problems = problems
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
