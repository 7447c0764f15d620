"""Temp folders a process owns while it lives, removed by a later one once their owner is gone.

The finish step and the health check spill to local temp folders (`rollouts-health-*`,
`rollouts-answers-*`, `rollouts-aggregate-*`) and remove them when they end. A process killed
meanwhile (SIGKILL, the OOM killer, a frozen worker killed after its takeover) cannot: the test
suite's killed workers alone left about 15 such folders a run. So each folder holds an `.owner`
file its process keeps an exclusive `flock` on; the kernel drops the lock when the process dies,
however it dies, and the next folder made with the same prefix on the host removes every one
whose lock it can take. A folder without an `.owner` (an older version's) is left alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading

__all__ = ["held", "make", "release", "remove", "sweep"]

OWNER = ".owner"

_held: dict[str, int] = {}
"""This process's folders and the descriptor that holds each one's lock."""
_lock = threading.Lock()


def make(prefix: str) -> str:
    """A new temp folder named `prefix...`, owned by this process until `remove` (or its death);
    the orphans of `prefix` go first."""
    sweep(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    # Locked before it is named `.owner`: a sweep never finds it unlocked.
    fd, pending = tempfile.mkstemp(dir=path, prefix=".owning-")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a filesystem without locks: an unowned folder, as before, never swept
        os.close(fd)
        os.unlink(pending)
        return path
    os.rename(pending, os.path.join(path, OWNER))
    with _lock:
        _held[path] = fd
    return path


def held() -> set[str]:
    """The folders this process made and still owns (not yet removed or released)."""
    with _lock:
        return set(_held)


def release(path: str) -> None:
    """Let go of the lock on `path` (its folder removed by other means)."""
    with _lock:
        fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a folder `make` made, and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    release(path)


def sweep(prefix: str) -> int:
    """Remove the temp folders named `prefix...` whose owner is gone; how many were removed."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(root, name)
        with _lock:
            if path in _held:
                continue
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDONLY)
        except OSError:  # no owner file (not made here), gone, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    return removed
