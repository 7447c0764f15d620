"""Per-process singletons that survive a fork: one instance per process and per key.

A Celery prefork child inherits its parent's objects, but not their threads, sockets or event
loops; every long-lived adapter (Redis clients, the admission gate, the lander, the HTTP loop) is
therefore made on first use in the process that uses it, and made again after a fork. The key is
what the instance connects to, so two URLs in one process get two instances.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class PerProcess(Generic[K, T]):
    """`get(key)` returns this process's instance for `key`, made by `factory(key)` on first use."""

    def __init__(self, factory: Callable[[K], T]) -> None:
        self._factory = factory
        self._pid = os.getpid()
        self._made: dict[K, T] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], T] | None = None) -> T:
        """`make()` instead of `factory(key)` when given (a key that stands for more than it is)."""
        if self._pid == os.getpid():
            found = self._made.get(key)
            if found is not None:
                return found
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's instances are not ours
                self._made = {}
                self._pid = os.getpid()
            found = self._made.get(key)
            if found is None:
                found = self._made[key] = make() if make is not None else self._factory(key)
            return found

    def existing(self) -> list[T]:
        """The instances this process made (for shutdown hooks); none after a fork."""
        if self._pid != os.getpid():
            return []
        with self._lock:
            return list(self._made.values())
