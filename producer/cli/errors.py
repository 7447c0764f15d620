"""How the command line ends on an error: `error: MESSAGE` on stderr, then the error's exit code.

The exit code is the error's own (`UsageError` 2, `RunFailedError` 1, any other `RolloutsError`
1; schemas/errors.py). Each command names the errors it reports this way with `@reports`; any
other exception propagates.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import NoReturn, ParamSpec, TypeVar

from rich.console import Console
from rich.markup import escape

from schemas.errors import RolloutsError, RunFailedError, UsageError

P = ParamSpec("P")
R = TypeVar("R")

COMMAND_ERRORS: tuple[type[RolloutsError], ...] = (UsageError, RunFailedError)
"""What a command reports unless it names other errors: bad usage (exit 2), a failed run (exit 1)."""

_errors = Console(stderr=True)


def fail(exc: RolloutsError) -> NoReturn:
    """Print `exc` as the command's error and exit with its code."""
    # Escaped: messages quote names like [simple_agent] that rich would read as markup.
    message = escape(str(exc))
    _errors.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    sys.exit(getattr(exc, "exit_code", 1))


def reports(
    *errors: type[RolloutsError],
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A command that ends with `fail` on `errors` (default: `COMMAND_ERRORS`)."""
    caught = errors or COMMAND_ERRORS

    def decorate(command: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(command)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return command(*args, **kwargs)
            except caught as exc:
                fail(exc)

        return run

    return decorate
