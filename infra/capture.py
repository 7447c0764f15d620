"""The model-call capture directory, NeMo Gym 0.7.0's layout on any fsspec store.

One `<key>.capture.jsonl` per rollout attempt (the key is the rollout id, `-a<n>` for attempts
after the first), one JSON line per model call in append order, and an empty
`<key>.capture.incomplete` marker when a write for that key failed (as NeMo Gym 0.7.0 marks it). The
capture proxy (`infra/capture_proxy.py`) appends; the worker clears a rollout's keys before it
is dispatched and reads them back to merge into its result (`workers/capture`).

On a local folder each append takes an exclusive `flock`, then writes, flushes and fsyncs, as
NeMo Gym's store does, so several proxies and rollouts write at once. On an object store a
line is one write-once segment object after the logical end (`RunDir.append_at`); a writer
that finds its place taken reads the end again and retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from infra.store import RunDir, WriteConflictError

CAPTURE_SUFFIX = ".capture.jsonl"
INCOMPLETE_SUFFIX = ".capture.incomplete"
APPEND_TRIES = 20


def valid_key(key: str) -> bool:
    """NeMo Gym's `CaptureStore` rule: non-empty, ASCII letters, digits and `._-` only."""
    return bool(key) and key.isascii() and all(c.isalnum() or c in "._-" for c in key)


class CaptureStore:
    """The capture files of one `model_call_capture_dir`."""

    def __init__(self, url: str) -> None:
        self.dir = RunDir(url)
        self.url = self.dir.url

    def _names(self, key: str) -> tuple[str, str]:
        if not valid_key(key):
            raise ValueError(f"invalid capture key {key!r}")
        return key + CAPTURE_SUFFIX, key + INCOMPLETE_SUFFIX

    def append(self, key: str, line: bytes) -> None:
        """Append one capture line (a JSON object and its newline) for `key`."""
        name, _ = self._names(key)
        if self.dir.is_local:
            self.dir.makedirs()
            with open(self.dir.path(name), "ab") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                try:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return
        for _ in range(APPEND_TRIES):
            try:
                self.dir.append_at(name, line, self.dir.size(name))
                return
            except WriteConflictError:
                continue
        raise WriteConflictError(f"{self.dir.path(name)}: {APPEND_TRIES} writers got there first")

    def mark_incomplete(self, key: str) -> None:
        """Touch the incomplete marker: a write of an exchange for `key` failed."""
        _, marker = self._names(key)
        if self.dir.is_local:
            self.dir.makedirs()
        self.dir.fs.pipe_file(self.dir.path(marker), b"")

    def read(self, key: str) -> tuple[bytes | None, bool]:
        """(the capture file's bytes, None when absent; whether the incomplete marker exists)."""
        name, marker = self._names(key)
        incomplete = bool(self.dir.fs.exists(self.dir.path(marker)))
        if self.dir.is_local:
            try:
                with open(self.dir.path(name), "rb") as f:
                    fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                    return f.read(), incomplete
            except FileNotFoundError:
                return None, incomplete
        if not self.dir.exists(name):
            return None, incomplete
        return self.dir.read_bytes(name), incomplete

    def clear(self, key: str) -> None:
        """Remove `key`'s capture file and marker (before the rollout is dispatched)."""
        name, marker = self._names(key)
        self.dir.remove(name)
        with contextlib.suppress(FileNotFoundError):
            self.dir.fs.rm_file(self.dir.path(marker))
