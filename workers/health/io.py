"""Streaming reads and writes for the health check: byte ranges of shards, whole-file writers.

Shards are read through `RunDir.iter_lines`, so a check reads the logical file on every store.
Reports and scratch runs are written as a stream (never held whole in memory): on a local
folder into a temporary file renamed over the target, on an object store as one upload that
becomes visible when it completes.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TypeVar

from infra.store import RunDir, replacing_file

SCRATCH_BLOCK = 1 << 18


def iter_range(
    rd: RunDir, name: str, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """`(offset, line)` for each line whose first byte lies in [start, end).

    A line that straddles `start` belongs to the range before. A last line without a newline is
    read too (a file written by another tool may lack the final newline).
    """
    return _range(rd, name, start, end, rd.iter_lines(name, max(0, start - 1)))


def iter_range_views(
    rd: RunDir, name: str, start: int = 0, end: int | None = None
) -> Iterator[tuple[int, bytes | memoryview]]:
    """`iter_range` for a reader that only parses each line (`RunDir.iter_line_views`)."""
    return _range(rd, name, start, end, rd.iter_line_views(name, max(0, start - 1)))


Line = TypeVar("Line", bytes, bytes | memoryview)


def _range(
    rd: RunDir, name: str, start: int, end: int | None, lines: Iterator[tuple[int, Line]]
) -> Iterator[tuple[int, Line]]:
    """The lines of `lines` (read from byte start-1) that begin in [start, end), and a last
    line without a newline."""
    with contextlib.closing(lines):  # type: ignore[type-var]
        position = 0
        if start > 0:
            # The piece from start-1 is the tail of a line that began before `start` (empty when
            # byte start-1 is the newline that ends it); with no newline at all, there is no
            # line of this range.
            first = next(lines, None)
            if first is None:
                return
            position = first[0] + len(first[1]) + 1
        for offset, line in lines:
            if end is not None and offset >= end:
                return
            position = offset + len(line) + 1
            yield offset, line
    if end is None or position < end:
        last = tail(rd, name, position)
        if last:
            yield position, last


def tail(rd: RunDir, name: str, position: int) -> bytes:
    """The bytes of a last line that has no newline, if any (everything before was read)."""
    size = rd.size(name)
    if size <= position:
        return b""
    with rd.fs.open(rd.path(name), "rb") as f:
        f.seek(position)
        data: bytes = f.read(size - position)
    return data if b"\n" not in data else b""


def file_digest(rd: RunDir, name: str) -> tuple[int, str]:
    """(size, SHA-256) of a file's bytes, read as a stream."""
    size = rd.size(name)
    h = hashlib.sha256()
    for offset, line in iter_range(rd, name):
        h.update(line)
        if offset + len(line) < size:
            h.update(b"\n")
    return size, h.hexdigest()


@contextmanager
def open_writer(rd: RunDir, name: str, durable: bool = True) -> Iterator[IO[bytes]]:
    """A binary file that replaces `name` when the block exits cleanly (and never on error).

    `durable` syncs a local file before it replaces the target (reports; not scratch files).
    """
    target = rd.path(name)
    if rd.is_local:
        with replacing_file(target, durable) as f:
            yield f
        return
    f = rd.fs.open(target, "wb")
    try:
        yield f
    except BaseException:
        # Abort the upload so that nothing becomes visible.
        discard = getattr(f, "discard", None)
        if discard is not None:
            with contextlib.suppress(Exception):
                discard()
        raise
    f.close()


def iter_scratch(rd: RunDir, name: str) -> Iterator[bytes]:
    """Lines of a scratch file, read in small blocks (many are open at once while merging)."""
    with rd.fs.open(rd.path(name), "rb") as f:
        pending = b""
        while True:
            block = f.read(SCRATCH_BLOCK)
            if not block:
                break
            pending += block
            lines = pending.split(b"\n")
            pending = lines.pop()
            yield from lines
    if pending:
        yield pending
