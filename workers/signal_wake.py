"""A consumer step: a signal wakes the worker's event loop at once, whichever thread it reached.

Python runs signal handlers in the main thread, but the kernel hands a process-wide signal to
any thread that does not block it, and a worker has dozens (its rollout threads, the I/O loop,
the lease and lock keepers). When SIGTERM reached one of those, the main thread slept on in the
event loop's poll until its next timer, up to a second, before Celery began its warm shutdown.
Python's wakeup fd (`signal.set_wakeup_fd`) is written by the C-level handler in whatever thread
took the signal; its read end is one more reader of the event loop, so the poll returns and the
handler runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from celery import bootsteps

__all__ = ["SignalWake"]


class SignalWake(bootsteps.StartStopStep):  # type: ignore[misc]  # celery's bootsteps are untyped
    """Registers a wakeup fd for signals with the consumer's event loop while the worker runs."""

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._fds: tuple[int, int] | None = None
        self._previous = -1

    def start(self, c: Any) -> None:
        hub = getattr(c, "hub", None)
        if hub is None or self._fds is not None:
            return  # no event loop: nothing sleeps in its poll
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: signals are left as they are
            os.close(read)
            os.close(write)
            return
        self._fds = (read, write)
        hub.add_reader(read, self._drain, read)

    def _drain(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(fd, 512):
                pass

    def stop(self, c: Any) -> None:
        if self._fds is None:
            return
        read, write = self._fds
        self._fds = None
        hub = getattr(c, "hub", None)
        if hub is not None:
            with contextlib.suppress(Exception):  # a hub already closed keeps no reader
                hub.remove_reader(read)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous)
        os.close(read)
        os.close(write)

    shutdown = stop
