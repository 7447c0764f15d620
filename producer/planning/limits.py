"""Input limits checked while planning: the size of a row, read in bounded chunks, and its depth.

A row past `max_row_bytes` cannot be published as a task, and one nested past `MAX_ROW_DEPTH`
cannot be encoded again by orjson (255 levels) once stamped or echoed; both are refused at
planning, naming the line. An input line is never held whole to find that out: `bounded_lines`
splits fixed-size chunks and, once a line outgrows the limit, drops what it held and only counts
the rest of it, so a 1 GB line costs one chunk of memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 1 << 20
MAX_ROW_DEPTH = 100
"""Levels of nested objects and arrays in a row, the row itself being level 1."""


@dataclass(frozen=True)
class Oversize:
    """A line longer than the limit, skipped without being held: `size` bytes, newline excluded."""

    size: int


Line = tuple[int, bytes | Oversize]


def bounded_lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[Line]:
    """(1-based line number, line without its newline, or `Oversize`) of a byte stream's lines.

    Numbered as iterating a file numbers them: a last line without a newline counts, an input
    that ends in a newline has no empty line after it. At most `max_bytes` of a line are held.
    """
    line_no = 0
    head: list[bytes] = []
    held = 0  # bytes of the current line so far (counted, not kept, once it is over the limit)
    for chunk in chunks:
        if not chunk:
            continue
        parts = chunk.split(b"\n")
        for part in parts[:-1]:
            line_no += 1
            size = held + len(part)
            if size > max_bytes:
                yield line_no, Oversize(size)
            elif head:
                head.append(part)
                yield line_no, b"".join(head)
            else:
                yield line_no, part
            head.clear()
            held = 0
        tail = parts[-1]
        if tail:
            held += len(tail)
            if held <= max_bytes:
                head.append(tail)
            else:
                head.clear()
    if held:
        yield line_no + 1, (Oversize(held) if held > max_bytes else b"".join(head))


def file_lines(path: str, max_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Line]:
    """`bounded_lines` of a local file."""
    with open(path, "rb") as f:
        yield from bounded_lines(iter(lambda: f.read(chunk_bytes), b""), max_bytes)


def too_deep(row: dict[str, Any], raw: bytes, limit: int = MAX_ROW_DEPTH) -> bool:
    """Whether `row` (parsed from `raw`) nests objects and arrays more than `limit` levels deep."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return False  # too few brackets to be that deep: the common row is not walked
    stack: list[tuple[Any, int]] = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        for child in value.values() if type(value) is dict else value:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False
